"""HTTP routes of /v1/tenants (platform admins; tenant admins for their own tokens) and /v1/usage."""

from __future__ import annotations

import logging
import re
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response, status

from kembed_api.auth import service as auth_service
from kembed_api.auth.models import ApiToken
from kembed_api.auth.principal import Admin, Db, Principal, Reader, TokenManager
from kembed_api.auth.roles import Role, may_hold
from kembed_api.platform import errors
from kembed_api.platform.responses import ModelResponse
from kembed_api.tenants import service
from kembed_api.tenants.models import Tenant
from kembed_api.tenants.schemas import (
    SharingSpec,
    TenantCreate,
    TenantList,
    TenantRead,
    TenantUpdate,
    TokenCreate,
    TokenCreated,
    TokenList,
    TokenRead,
    Usage,
)

router = APIRouter(tags=["tenants"])
log = logging.getLogger(__name__)

_TENANT_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NOT_FOUND_TENANT = "No such tenant, or not the caller's (another tenant's answers exactly like a missing one)."
_ADMIN_ONLY = "Only platform admins may do this."
TokenId = Annotated[int, Path(ge=1, le=2**31 - 1, description="The token's id (from the token list).")]


def _tenant_for(principal: Principal, session, name: str) -> Tenant:
    """The named tenant, if the caller may see it: its own, or any for a platform admin. Else 404."""
    if (principal.role is not Role.PLATFORM_ADMIN and principal.tenant.name != name) or not _TENANT_NAME.match(name):
        raise HTTPException(status.HTTP_404_NOT_FOUND, "tenant not found")
    try:
        return service.get_tenant(session, name=name)
    except service.TenantNotFound:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "tenant not found") from None


_BAD_POLICY = "Invalid body, or a storage prefix no tenant may be granted (`detail` says which and why)."


@router.post("/v1/tenants", response_model=TenantRead, status_code=status.HTTP_201_CREATED,
             responses=errors.responses(401, 403, 409, s403=_ADMIN_ONLY, s409="A tenant of that name exists.",
                                        s422=_BAD_POLICY),
             summary="Create a tenant")
def create_tenant(body: TenantCreate, request: Request, db: Db, _: Admin) -> TenantRead:
    _check_priority_class(request, body.sharing)
    storage = request.app.state.storage
    try:
        with db.session(write=True) as session:
            # What the body leaves out of the quota comes from the platform's default quota (settings).
            quota = request.app.state.settings.default_quota.merged(body.quota)
            tenant = service.create_tenant(session, name=body.name, quota=quota, sharing=body.sharing,
                                           storage=storage, storage_spec=body.storage)
    except service.TenantExists as error:
        raise HTTPException(status.HTTP_409_CONFLICT, str(error)) from None
    except ValueError as error:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(error)) from None
    _sync(request, tenant)
    return service.to_read(tenant, storage=storage)


def _check_priority_class(request: Request, sharing: SharingSpec | None) -> None:
    classes = request.app.state.settings.priority_classes
    if sharing is not None and sharing.max_priority_class is not None and sharing.max_priority_class not in classes:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "sharing.max_priority_class: not one of the "
                            f"platform's priority classes ({', '.join(sorted(classes, key=classes.get))})")


def _sync(request: Request, tenant: Tenant) -> None:
    """Mirror the tenant into the backend (its Kubernetes Tenant) now; the dispatcher retries at the next launch."""
    try:
        request.app.state.backend.sync_tenant(tenant.name, service.quota_spec(tenant), service.sharing_of(tenant),
                                              service.policy_of(tenant, request.app.state.storage))
    except Exception:  # the database is the system of record; the cluster catches up on the next launch
        log.warning("could not sync tenant %s to the backend", tenant.name, exc_info=True)


@router.get("/v1/tenants", response_model=TenantList, responses=errors.responses(401, 403, s403=_ADMIN_ONLY),
            summary="List tenants")
def list_tenants(request: Request, db: Db, _: Admin) -> TenantList:
    with db.session() as session:
        return TenantList(items=[service.to_read(t, storage=request.app.state.storage)
                                 for t in service.list_tenants(session)])


@router.get("/v1/tenants/{name}", response_model=TenantRead, responses=errors.responses(401, 404, s404=_NOT_FOUND_TENANT),
            summary="One tenant: quota and storage policy")
def get_tenant(name: str, request: Request, db: Db, principal: Reader) -> TenantRead:
    with db.session() as session:
        return service.to_read(_tenant_for(principal, session, name), storage=request.app.state.storage)


@router.patch("/v1/tenants/{name}", response_model=TenantRead,
              responses=errors.responses(401, 403, 404, s403=_ADMIN_ONLY, s404=_NOT_FOUND_TENANT, s422=_BAD_POLICY),
              summary="Set a tenant's quota, sharing and/or storage policy")
def update_tenant(name: str, body: TenantUpdate, request: Request, db: Db, principal: Admin) -> TenantRead:
    _check_priority_class(request, body.sharing)
    storage = request.app.state.storage
    with db.session(write=True) as session:
        tenant = _tenant_for(principal, session, name)
        if body.quota is not None:  # merge: only the fields given change
            service.set_quota(tenant, service.quota_spec(tenant).merged(body.quota))
        if body.sharing is not None:
            service.set_sharing(tenant, body.sharing)
        if body.storage is not None:
            try:
                service.set_storage(tenant, body.storage, storage=storage)
            except ValueError as error:
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(error)) from None
        read = service.to_read(tenant, storage=storage)
    request.app.state.principals.clear()  # callers of this tenant see the new quota at once
    _sync(request, tenant)
    request.app.state.dispatcher.wake()  # a larger quota may admit waiting jobs now
    return read


@router.get("/v1/tenants/{name}/usage", response_model=Usage, responses=errors.responses(401, 404, s404=_NOT_FOUND_TENANT),
            summary="A tenant's quota against its use")
def tenant_usage(name: str, db: Db, principal: Reader) -> Response:
    with db.session() as session:
        return ModelResponse(service.usage(session, tenant=_tenant_for(principal, session, name)))


@router.get("/v1/usage", response_model=Usage, responses=errors.responses(401),
            summary="The caller's tenant: quota, use, queue, GPU-hours")
async def my_usage(db: Db, principal: Reader) -> Response:
    return ModelResponse(await db.read(lambda connection: service.usage(connection, tenant=principal.tenant)))


# ----------------------------------------------------------------------------------------------- tokens
def _token_read(token: ApiToken) -> TokenRead:
    return TokenRead(id=token.id, name=token.name, role=Role(token.role), prefix=token.prefix,
                     created_at=token.created_at, expires_at=token.expires_at, revoked_at=token.revoked_at)


@router.post("/v1/tenants/{name}/tokens", response_model=TokenCreated, status_code=status.HTTP_201_CREATED,
             responses=errors.responses(401, 403, 404, s404=_NOT_FOUND_TENANT,
                                        s403="The role may not manage tokens, or may not mint one of this role "
                                        "(only platform admins mint platform-admin tokens)."),
             summary="Create a token (its secret is shown once)")
def create_token(name: str, body: TokenCreate, db: Db, principal: TokenManager) -> TokenCreated:
    if not may_hold(principal.role, body.role):
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"role: a {principal.role.value} may not create {body.role.value} tokens")
    with db.session(write=True) as session:
        tenant = _tenant_for(principal, session, name)
        token, secret = auth_service.create_token(session, tenant=tenant, name=body.name, role=body.role,
                                                  expires_at=body.expires_at)
        return TokenCreated(**_token_read(token).model_dump(), token=secret)


@router.get("/v1/tenants/{name}/tokens", response_model=TokenList,
            responses=errors.responses(401, 403, 404, s404=_NOT_FOUND_TENANT),
            summary="List a tenant's tokens (never their secrets; platform-admin tokens to platform admins only)")
def list_tokens(name: str, db: Db, principal: TokenManager) -> TokenList:
    with db.session() as session:
        tenant = _tenant_for(principal, session, name)
        return TokenList(items=[_token_read(t) for t in auth_service.list_tokens(session, tenant=tenant,
                                                                                 caller=principal.role)])


@router.delete("/v1/tenants/{name}/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses=errors.responses(
                   401, 403, 404, s404="No such token or tenant for the caller (a token the caller may not see, "
                   "such as a platform admin's, answers exactly like a missing one)."),
               summary="Revoke a token")
def revoke_token(name: str, token_id: TokenId, request: Request, db: Db, principal: TokenManager) -> Response:
    with db.session(write=True) as session:
        tenant = _tenant_for(principal, session, name)
        if auth_service.revoke_token(session, tenant=tenant, token_id=token_id, caller=principal.role) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"token {token_id} not found")
    request.app.state.principals.clear()  # the revoked token stops working here at once
    return Response(status_code=status.HTTP_204_NO_CONTENT)
