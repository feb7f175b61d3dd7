"""API tokens and roles: who is calling, for which tenant, allowed to do what."""
