"""The one exception type of ms-probe."""


class ProbeError(ValueError):
    """Bad input to ms-probe: a config value, a dump folder, a mapping file; the message names it."""
