"""The engine's configuration: every key, its parsing and its checks (settings)."""
