"""The dashboard's HTML pages, served by the API process on its own port: sign in and out, team, history, job,
tokens, platform admin.

Pages are Jinja2 shells; what they show comes from the JSON API (the same endpoints clients use), fetched by
static/dashboard.js with the session cookie. A page a role may not see, or a job of another tenant, is a 404 page.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Request, Response, status
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from kembed_api import __version__
from kembed_api.auth import service as auth_service
from kembed_api.auth import sessions
from kembed_api.auth.principal import Principal, session_principal
from kembed_api.auth.roles import Action, Role, allowed
from kembed_api.jobs import errors, reads
from kembed_contract import lifecycle, runtime
from kembed_contract.quota import QuotaSpec

__all__ = ["HOME", "QUOTA_DIMENSIONS", "STATIC_DIR", "router"]

HOME = "/dashboard"
SIGN_IN = f"{HOME}/sign-in"
_MAX_FORM_BYTES = 4096  # a sign-in form holds one token

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
STATIC_DIR = Path(__file__).parent / "static"


# The lifecycle's states as the page script needs them (which end a job, how each looks): served, not restated.
_STATE_TONES = json.dumps({state.value: tone.value for state, tone in lifecycle.STATE_TONES.items()}
                          | {"terminal": sorted(s.value for s in lifecycle.TERMINAL_STATES)})
# The quota's dimensions as the page script draws them (a bar, a column, a form field each): served, not restated.
QUOTA_DIMENSIONS = json.dumps([
    {"field": d.field, "amount": d.amount, "label": d.label, "unit": d.unit, "kind": d.stored.value, "used": d.used,
     "held": d.held is not None}
    for d in QuotaSpec.dimensions()
])


async def _principal(request: Request) -> Principal | None:
    return await session_principal(request)


def _render(request: Request, template: str, principal: Principal | None, *, status_code: int = 200,
            **context: Any) -> HTMLResponse:
    secret = request.cookies.get(sessions.COOKIE_NAME)
    context.update(
        version=__version__,
        principal=principal,
        tenant=principal.tenant.name if principal else None,
        role=principal.role.value if principal else None,
        can_submit=bool(principal and allowed(principal.role, Action.SUBMIT)),
        can_manage_tokens=bool(principal and allowed(principal.role, Action.MANAGE_TOKENS)),
        is_platform_admin=bool(principal and principal.role is Role.PLATFORM_ADMIN),
        csrf_token=sessions.csrf_token(secret) if secret and principal else "",
        csrf_field=sessions.CSRF_FIELD,
        csrf_header=sessions.CSRF_HEADER,
        home=HOME,
        state_tones=_STATE_TONES,
        quota_dimensions=QUOTA_DIMENSIONS,
    )
    response = templates.TemplateResponse(request, template, context, status_code=status_code)
    # Pages hold nothing secret but are per-user: never stored by shared caches; no framing (clickjacking).
    response.headers["Cache-Control"] = "private, no-store"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = ("default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                                   "frame-ancestors 'none'; form-action 'self'")
    response.headers["Referrer-Policy"] = "same-origin"
    return response


def _not_found(request: Request, principal: Principal | None, what: str) -> HTMLResponse:
    return _render(request, "not_found.html", principal, status_code=status.HTTP_404_NOT_FOUND, what=what)


def _to_sign_in() -> RedirectResponse:
    return RedirectResponse(SIGN_IN, status_code=status.HTTP_303_SEE_OTHER)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse(HOME, status_code=status.HTTP_307_TEMPORARY_REDIRECT)


# ------------------------------------------------------------------------------------------- sign in / out
@router.get(SIGN_IN, response_class=HTMLResponse)
async def sign_in_page(request: Request) -> Response:
    if await _principal(request) is not None:
        return RedirectResponse(HOME, status_code=status.HTTP_303_SEE_OTHER)
    return _render(request, "sign_in.html", None)


def _start_session(request: Request, secret: str) -> str | None:
    settings = request.app.state.settings
    with request.app.state.db.session(write=True) as session:
        found = auth_service.authenticate(session, secret=secret)
        if found is None:
            return None
        return sessions.start(session, token=found[0], ttl=timedelta(seconds=settings.session_ttl_s))


def _from_elsewhere(request: Request) -> bool:
    """A form posted by a page of another site (its Origin names another host). Refused at sign-in, so that no
    site can sign a visitor in as someone else (login CSRF); the scheme is not compared, as a TLS-terminating
    Ingress changes it."""
    origin = request.headers.get("origin")
    return bool(origin) and urlsplit(origin).netloc != request.headers.get("host", "")


@router.post(SIGN_IN, response_class=HTMLResponse)
async def sign_in(request: Request) -> Response:
    if _from_elsewhere(request):
        return Response("sign-in from another site refused", status_code=status.HTTP_403_FORBIDDEN)
    body = await request.body()
    form = parse_qs(body[:_MAX_FORM_BYTES].decode(errors="replace"))
    token = (form.get("token") or [""])[0].strip()
    secret = await run_in_threadpool(_start_session, request, token) if 0 < len(token) <= 200 else None
    if secret is None:
        return _render(request, "sign_in.html", None, status_code=status.HTTP_401_UNAUTHORIZED,
                       error="That token is not valid (unknown, expired or revoked).")
    settings = request.app.state.settings
    secure = settings.secure_cookies if settings.secure_cookies is not None else request.url.scheme == "https"
    response = RedirectResponse(HOME, status_code=status.HTTP_303_SEE_OTHER)
    response.set_cookie(sessions.COOKIE_NAME, secret, max_age=int(settings.session_ttl_s), path="/",
                        httponly=True, samesite="strict", secure=secure)
    return response


def _end_session(request: Request, secret: str) -> None:
    with request.app.state.db.session(write=True) as session:
        sessions.end(session, secret=secret)
    request.app.state.principals.clear()  # the ended session stops working on this replica at once


@router.post(f"{HOME}/sign-out")
async def sign_out(request: Request) -> Response:
    secret = request.cookies.get(sessions.COOKIE_NAME)
    if secret:
        form = parse_qs((await request.body())[:_MAX_FORM_BYTES].decode(errors="replace"))
        if not sessions.csrf_matches(secret, (form.get(sessions.CSRF_FIELD) or [None])[0]):
            return Response("missing or wrong CSRF token", status_code=status.HTTP_403_FORBIDDEN)
        await run_in_threadpool(_end_session, request, secret)
    response = _to_sign_in()
    response.delete_cookie(sessions.COOKIE_NAME, path="/", httponly=True, samesite="strict")
    return response


# ------------------------------------------------------------------------------------------------- pages
@router.get(HOME, response_class=HTMLResponse)
async def team_page(request: Request) -> Response:
    principal = await _principal(request)
    if principal is None:
        return _to_sign_in()
    return _render(request, "team.html", principal, page="team")


@router.get(f"{HOME}/history", response_class=HTMLResponse)
async def history_page(request: Request) -> Response:
    principal = await _principal(request)
    if principal is None:
        return _to_sign_in()
    return _render(request, "history.html", principal, page="history")


def _job_exists(request: Request, principal: Principal, job_id: str) -> bool:
    with request.app.state.db.session() as session:
        try:
            reads.get_job(session, tenant=principal.tenant, job_id=job_id)
        except errors.JobNotFound:
            return False
    return True


@router.get(HOME + "/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(request: Request, job_id: str) -> Response:
    principal = await _principal(request)
    if principal is None:
        return _to_sign_in()
    if len(job_id) > 63 or not await run_in_threadpool(_job_exists, request, principal, job_id):
        return _not_found(request, principal, f"job {job_id}")
    # What the job's checkpoint folder is when its spec named none (one rule, kembed_contract.runtime's): "Submit
    # again" gives the new job a folder of its own unless the old one named its own.
    default_folder = runtime.job_checkpoint_folder(request.app.state.storage.own_folder(principal.tenant.name), job_id)
    return _render(request, "job.html", principal, page="job", job_id=job_id, default_checkpoint_folder=default_folder)


@router.get(f"{HOME}/tokens", response_class=HTMLResponse)
async def tokens_page(request: Request) -> Response:
    principal = await _principal(request)
    if principal is None:
        return _to_sign_in()
    if not allowed(principal.role, Action.MANAGE_TOKENS):
        return _not_found(request, principal, "this page")
    return _render(request, "tokens.html", principal, page="tokens")


@router.get(f"{HOME}/admin", response_class=HTMLResponse)
async def admin_page(request: Request) -> Response:
    principal = await _principal(request)
    if principal is None:
        return _to_sign_in()
    if principal.role is not Role.PLATFORM_ADMIN:
        return _not_found(request, principal, "this page")
    return _render(request, "admin.html", principal, page="admin")
