"""What a user runs: the `tutti` command line (cli), the demo, and the read-only store tools
(`tutti inspect`, `tutti verify`)."""
