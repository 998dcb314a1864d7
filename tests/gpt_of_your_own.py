"""A GPT "of your own" for train.model_module tests: model.py's, reached through a file path."""
from model import GPT  # noqa: F401
