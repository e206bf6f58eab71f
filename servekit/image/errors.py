"""The root of every error servekit shows a person, here in the image's package, the lowest floor, so that the image's
own errors (a refused value, a series that does not apply, a hub that does not answer, a conversion that cannot be
done) are of it too: the command line turns any of them into one line and its exit code, never a traceback.
servekit/errors.py adds the host's kinds (a check that failed, what the machine lacks, a boot that failed)."""


class ServekitError(Exception):
    """The message is what the person should read (what, where, how to fix); `exit_code` what the command exits with."""

    exit_code = 1


class UserError(ServekitError):
    """Bad input or usage: exit 2."""

    exit_code = 2
