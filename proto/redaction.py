"""Credentials out of every text a client or a log may see: `redact` (stdlib only, linear time).

Used by every message a replica sends a client (server/errors.py), its log filter (server/serve.py), the
Redis connection policy's errors (redis_conn.py) and the CLI's status output.
"""

from __future__ import annotations

import re

# ://user:password@ -> ://user:***@ ; and a password given as a URL query parameter. Greedy up to the
# last "@" before the path: a password may hold an unencoded "@".
#
# Linear in the text: redact() runs on every error message a client gets and every log line, and both
# may quote a client's string. The pattern is anchored on the literal "://" (found by a fast scan), not
# on the scheme before it: a scheme pattern such as [A-Za-z][A-Za-z0-9+.-]* is tried at every letter of
# a long word and backtracks over the rest of it, quadratic (a 40 000-letter model name took 6 s). The
# user and password parts stop at the next "/" (every "://" holds one) or whitespace, so the scans of
# two attempts never overlap. Any scheme's credentials are redacted, a scheme-less "://u:p@" too.
_USERINFO = re.compile(r"://([^:/@\s]*+):[^/\s]*@")
_QUERY_PASSWORD = re.compile(r"([?&](?:password|pass|passwd)=)[^&\s'\"]*+", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***; the rest (host, port, db) kept,
    since that is what an operator needs to find the unreachable server. Linear time (see above)."""
    if "://" in text:
        text = _USERINFO.sub(r"://\1:***@", text)
    return _QUERY_PASSWORD.sub(r"\1***", text)
