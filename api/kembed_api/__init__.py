"""kembed's API server: the system of record for tenants, jobs and their queue."""

__version__ = "0.1.0"
__all__ = ["__version__"]
