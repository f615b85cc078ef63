"""User-facing errors: the CLI turns each into exit code 2 and one line, never a traceback."""


class UserError(Exception):
    """Bad input from the user (config, environment, data, checkpoints): exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """The configuration or the command line is invalid."""


class DataError(UserError):
    """The data is missing or malformed."""


class CheckpointError(UserError):
    """No usable checkpoint where one was required."""


class LaunchError(UserError):
    """The launch environment (torchrun variables, devices) is inconsistent."""
