"""A Harbor API stand-in for the tests: a real HTTP(S) server checked against Harbor's OpenAPI spec."""
from .server import ADMIN, HarborStandIn
from .spec import HarborSpec, SpecViolation

__all__ = ["ADMIN", "HarborSpec", "HarborStandIn", "SpecViolation"]
