class UserError(Exception):
    """Bad input from the user (a file, a config field, a flag).

    The CLI prints these as one line, `error: <message>`, and exits with status 2; the message
    names the file or field and what was expected. Anything else is a bug and keeps its traceback.
    """
