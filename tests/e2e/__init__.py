"""End-to-end tests: real jobs synced through the real uploader into the sink."""
