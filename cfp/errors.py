"""Error classes: every bad input raises one of these with a message naming the value and valid choices."""


class CfpError(Exception):
    """Base class of cfp's own errors."""


class ConfigError(CfpError, ValueError):
    """An invalid option, config or layout given by the user."""


class CaptureError(CfpError):
    """A program that capture cannot see through."""


class InfeasibleError(CfpError):
    """No plan satisfies the constraints (for example the memory budget)."""


class PlanError(ConfigError):
    """A plan or profile-cache file that is not what cfp wrote, or a plan that does not fit the step."""
class NumericalError(CfpError):
    """NaN or Inf in a loss, gradient or parameter (never a pass)."""
