"""The one exception type that reaches users as a message instead of a traceback."""


class DraftsmithError(Exception):
    """Bad input or an unusable environment: the message says what is wrong and what to do.

    Entry points catch it, print ``error: <message>`` and exit with status 2.
    """
