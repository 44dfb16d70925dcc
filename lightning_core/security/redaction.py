"""Secrets out of what is logged: the password inside a URL and its secret query values.

A setting that is a URL can carry a credential (`tracking_uri=postgresql://mlflow:pw@db/mlflow`,
`vllm_url=http://user:pw@gpu-box:8000`, `...?token=...`). The run needs it, but every place
that records the config (MLflow params, Prefect's flow-run parameters, log lines, error
messages) shows it to whoever can read those. `redact` is the one function they pass text
through: the URL keeps its scheme, user, host, path and query keys, so a reader still sees
where it points.

A setting can also be a credential by its name (`api_key` in a backend's options, a
`webhook_secret`): `redact_values` and `redact_setting` mask the value of such a name whatever it
holds, for the settings that travel as plain dicts, which no SecretStr types.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# What a recorded secret reads as: MASK, or pydantic's SecretStr in JSON. A value equal to one
# of these is a record read back (a saved config, a deployment's parameters), never a key.
MASKS = frozenset({MASK, "**********"})
# Any scheme, SQLAlchemy's included (postgresql+psycopg2://), up to whitespace or a quote.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
# Query keys whose values are credentials (access_token, api_key, X-Amz-Signature, ...).
_SECRET_KEY = re.compile(r"token|key|pass|pwd|secret|sig|credential|auth", re.IGNORECASE)


# Setting names whose values are credentials: api_key, webhook_secret, password, hf_token; not
# max_tokens, api_key_env (a variable's name), key_file (a path) or tier_key (a field's name).
_SECRET_NAME = re.compile(
    r"(?:^|_)(?:api_key|secret|password|passwd|token|credentials?)$", re.IGNORECASE
)


def is_secret_name(name: str) -> bool:
    """Whether a setting called `name` holds a credential (api_key, webhook_secret, ...)."""
    return bool(_SECRET_NAME.search(name))


def redact_setting(name: str, value: Any) -> Any:
    """`value` as a record may show it: masked whole under a secret's name (is_secret_name),
    else redacted as any value (redact_values)."""
    if is_secret_name(name) and value not in (None, ""):
        return MASK
    return redact_values(value)


def redact_url(url: str) -> str:
    """`url` with the password of its user info and its secret query values as '***'."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed IPv6 bracket: not a URL to take apart, so hide it all
        return MASK
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{host}" if colon else netloc
    query = "&".join(_redact_pair(pair) for pair in parts.query.split("&")) if parts.query else ""
    if netloc == parts.netloc and query == parts.query:
        return url  # nothing secret: unchanged, byte for byte
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_pair(pair: str) -> str:
    key, equals, value = pair.partition("=")
    return f"{key}={MASK}" if equals and value and _SECRET_KEY.search(key) else pair


def redact(text: str) -> str:
    """`text` with every URL in it redacted (redact_url); text without a URL is unchanged."""
    return _URL.sub(lambda found: redact_url(found.group(0)), text) if "://" in text else text


def redact_values(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings, numbers) with every string redacted, and the
    value of every key that names a secret masked whole."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_setting(str(key), item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [redact_values(item) for item in value]
    return value
