"""Helpers the tests share: the local sink and Flyte tools, synthetic and hostile runs, the reference merge, and the small jobs tests run with real wandb."""
