"""The one user-facing error type of the project.

Input is read and checked at the boundaries (config files and overrides, prompt files, model folders and specs,
reports, output paths, CLI flags); a bad value there raises `UserError` with the file or key, the problem and the
fix. The CLI prints it as one line and exits 2. Deeper code raises ordinary exceptions, so a genuine bug still shows
its traceback. It lives at the bottom floor so that every stage, the runtime included, raises the same type.
"""


class UserError(ValueError):
    """Bad input: the message names the problem and the fix (a ValueError, so `except ValueError` still sees it)."""
