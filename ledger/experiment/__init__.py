"""Torch-free facts of the experiment that writers (runners) and checkers (verify) both import: the configuration
schema and its contracts, the tokenizer, and the task documents."""
