"""The one exception type dflashkit raises for bad user input.

Every message names the remedy, so the CLI can print it without a traceback.
"""


class DFlashError(ValueError):
    """Bad input (configuration, checkpoint, request) with a message that says what to do."""
