"""Training loop and model zoo used by the recipes."""
