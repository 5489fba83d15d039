"""What the task tests share."""

from bigbatch.experiments.plan import plan_run


def text_config(**keys):
    """The text task at a test's size: a small model on windows of 8 bytes."""
    small = {"task": "text", "model.width": 16, "model.depth": 1, "model.context": 8}
    return plan_run({**small, **keys})
