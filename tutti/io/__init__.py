"""IO: one queue contract over io_uring, threads and libnvm, and the on-disk chunk store."""
