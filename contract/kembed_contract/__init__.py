"""kembed's contract: what the API, the operator and the local backend share, torch-free and web-free.

Modules, not names, are the public surface (import `kembed_contract.lifecycle`, ...); this file imports nothing so
that importing one module never pulls in the others.
"""
