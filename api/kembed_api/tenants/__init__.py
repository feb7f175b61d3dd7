"""Tenants (teams): who owns jobs. The embedded default has one built-in tenant."""
