"""One redaction routine for everything servelab writes under ``outputs/`` and into an archive.

Secrets are hidden three ways, always together (``docs/method.md#secrets``):

- **by name** — the value of an environment variable, mapping key, command-line flag (``--api-key X``,
  ``--token=X``), ``NAME=value`` assignment, URL query parameter (``?token=``, ``&api_key=``) or HTTP header
  (``Authorization: Bearer ...``) whose name is a secret's (:func:`is_secret_name`);
- **by shape** — Hugging Face, OpenAI-style, GitHub and AWS keys, private-key blocks, and the credentials of a URL
  (``http://user:pass@host`` keeps the user, hides the password);
- **by value** — every *known* secret value (the values of secret-named variables of the process environment and
  of the target's ``env``, the values of secret flags in its launch arguments) is replaced wherever it appears in
  a text, whatever surrounds it (:func:`known_secrets`).

Every writer calls :func:`redact_text` / :func:`redact` / :func:`redact_argv` / :func:`redact_env`;
:func:`scrub_notebook`, :func:`scrub_file` and :func:`scrub_tree` apply the same routine to files already written
(executed notebooks, a phase folder after it ran, each member of a zip).
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

REDACTED = "***REDACTED***"

# ---------------------------------------------------------------- names

# words that make a name a secret's wherever they stand (API_KEY, db.password, Authorization, clientSecret)
_SECRET_WORDS = {"secret", "password", "passwd", "credential", "credentials", "auth", "authorization", "apikey",
                 "accesskey", "privatekey", "secretkey", "bearer", "cookie"}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("client", "secret"),
                 ("session", "key"), ("signing", "key"), ("encryption", "key")}
# "token" names a secret (HF_TOKEN, access-token, token) unless it is the model's kind of token
_TOKENISH = {"bos", "eos", "pad", "unk", "sep", "cls", "mask", "first", "next", "last", "per", "output", "input",
             "prompt", "special", "start", "end", "stop", "new", "generated", "draft", "max", "min", "num", "total",
             "cached", "pending", "prefill", "decode", "accepted", "rejected", "retracted", "evicted", "used"}
# "pass" names a secret (DB_PASS, SSHPASS) unless it is a pass of a computation
_PASSISH = {"first", "second", "third", "forward", "backward", "single", "multi", "prefill", "decode", "one", "two",
            "each", "num", "n", "by"}
# a name ending with one of these names where a secret is kept, not the secret: api_key_env (a variable's NAME),
# password_file, token_path
_REFERENCE_WORDS = {"env", "var", "variable", "file", "path", "dir"}
# query parameters that carry a credential though their name alone would not say so
_QUERY_SECRET_NAMES = {"key", "sig", "signature", "code", "access_token", "id_token", "refresh_token"}


def _words(name: str) -> list[str]:
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name))        # apiKey -> api_Key
    return [w for w in re.split(r"[^A-Za-z0-9]+", name.lower()) if w]


def is_secret_name(name: str) -> bool:
    """``HF_TOKEN``, ``api-key``, ``db.password``, ``Authorization``, ``SSHPASS`` name secrets; ``max_tokens``,
    ``bos_token``, ``time_to_first_token``, ``token_count``, ``tokenizer``, ``first_pass`` and ``api_key_env`` (the
    name of the variable that holds a key) do not."""
    words = _words(name)
    if len(words) > 1 and words[-1] in _REFERENCE_WORDS:     # api_key_env, password_file: where a secret is, not it
        return False
    for i, w in enumerate(words):
        prev = words[i - 1] if i else ""
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if w in _SECRET_WORDS or (prev, w) in _SECRET_PAIRS:
            return True
        # token: the last word (HF_TOKEN, access-token, token) or before value/secret — token_check, token_ids are data
        if w in ("token", "hftoken") and prev not in _TOKENISH and nxt in ("", "value", "secret", "key"):
            return True
        if w in ("pass", "sshpass", "dbpass") and prev not in _PASSISH and nxt not in ("rate", "count", "id", "s"):
            return True
        if w.endswith("token") and w not in ("token",) and len(w) > 5 and w[:-5] in ("hf", "gh", "access", "auth",
                                                                                        "bearer", "api", "refresh"):
            return True
    return False


# kept for code that matched names with the regex itself
SECRET_NAME_RE = re.compile(r"(?:^|[_\-.])(TOKEN|SECRET|PASSWORD|PASSWD|PASS|API[_\-]?KEY|ACCESS[_\-]?KEY|"
                            r"PRIVATE[_\-]?KEY|SECRET[_\-]?KEY|CREDENTIALS?|AUTH)(?:$|[_\-.])", re.IGNORECASE)

# ---------------------------------------------------------------- shapes

SECRET_VALUE_RES = [
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),               # Hugging Face tokens
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"),             # OpenAI-style keys
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),        # GitHub tokens
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),      # GitHub fine-grained tokens
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),     # Slack tokens
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),                # AWS access key ids
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)"),
]
# scheme://user:password@host — the user stays, the password goes
URL_CREDENTIALS_RE = re.compile(r"(?P<pre>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/@:'\"<>]*:)(?P<pw>[^\s/@'\"<>]+)(?=@)")
# ?token=X / &api_key=X — only inside a URL (scheme://... or an absolute path with a query), never in code
QUERY_PARAM_RE = re.compile(r"(?P<pre>[?&](?P<name>[A-Za-z0-9_.\-]+)=)(?P<val>[^&#;\s'\"<>]+)")
URL_RE = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
PATH_QUERY_RE = re.compile(r"(?<![\w.)\]])/[A-Za-z0-9_\-./]*\?[^\s'\"<>`]+")
# Authorization: Bearer X / Authorization: Basic X / "Authorization": "Bearer X" / Bearer X
AUTH_HEADER_RE = re.compile(r"(?P<pre>\b(?:Proxy-)?Authorization[\"']?\s*[:=]\s*[\"']?(?:(?:Bearer|Basic|Token|Digest)\s+)?)"
                            r"(?P<val>[^\s\"',}]+)", re.IGNORECASE)
BEARER_RE = re.compile(r"(?P<pre>\bBearer\s+)(?P<val>[A-Za-z0-9._~+/=\-]{6,})")
# --api-key X / --api-key=X / -hft X, in a command written as text
FLAG_RE = re.compile(r"(?P<pre>(?<![\w\-])(?P<flag>--?[A-Za-z][A-Za-z0-9_.\-]*)(?:=|[ \t]+(?:[\"'])?))"
                     r"(?P<val>(?!-)[^\s\"']+)")
# NAME=value, NAME: value, "NAME": "value" (env assignments, YAML, JSON, headers like X-Api-Key: X)
ASSIGN_RE = re.compile(r"(?P<pre>(?<![\w\-.$])(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)[\"']?[ \t]*(?:=|:(?!//))[ \t]*[\"']?)"
                       r"(?P<val>(?![{\[])[^\s\"',;&}\]]+)")

_NOT_A_SECRET = {"", "none", "null", "true", "false", "yes", "no", "0", "1", "-", "<absent>", REDACTED.lower(),
                 "bearer", "basic", "digest"}


def _is_value(v: str) -> bool:
    return v.lower() not in _NOT_A_SECRET and not v.startswith("${") and REDACTED not in v


def _sub_named(rx: re.Pattern[str], text: str, secret: Any) -> str:
    def repl(m: re.Match[str]) -> str:
        if secret(m) and _is_value(m.group("val")):
            return m.group("pre") + REDACTED
        return m.group(0)
    return rx.sub(repl, text)


def _secret_query_name(name: str) -> bool:
    return (is_secret_name(name) or name.lower() in _QUERY_SECRET_NAMES
            or bool({"sig", "signature", "key", "token"} & set(_words(name))))


def _redact_query(url: str) -> str:
    return _sub_named(QUERY_PARAM_RE, url, lambda m: _secret_query_name(m.group("name")))


def _is_count(m: re.Match[str]) -> bool:
    """``#token: 122`` — a name written with ``#`` before it is a count in an engine's log line (SGLang's scheduler
    lines: ``#token``, ``#new-token``, ``#running-req``), never a secret's name."""
    return m.start() > 0 and m.string[m.start() - 1] == "#"


def redact_patterns(text: str, names: bool = True) -> str:
    """Hide what looks like a secret (by shape, and by name unless ``names=False``); no known values.

    ``names=False`` is for HTML and script: a page's inlined JavaScript holds ``{token:t}``-like code that the
    ``NAME: value`` and ``--flag value`` rules would break; the shapes, URL credentials, query parameters and
    ``Authorization`` headers still apply."""
    for rx in SECRET_VALUE_RES:
        text = rx.sub(REDACTED, text)
    text = URL_CREDENTIALS_RE.sub(lambda m: m.group("pre") + REDACTED, text)
    text = URL_RE.sub(lambda m: _redact_query(m.group(0)), text)
    if names:
        text = PATH_QUERY_RE.sub(lambda m: _redact_query(m.group(0)), text)
    text = _sub_named(AUTH_HEADER_RE, text, lambda m: True)
    text = _sub_named(BEARER_RE, text, lambda m: True)
    if names:
        text = _sub_named(FLAG_RE, text, lambda m: is_secret_name(m.group("flag").lstrip("-")))
        text = _sub_named(ASSIGN_RE, text, lambda m: is_secret_name(m.group("name")) and not _is_count(m))
    return text


# ---------------------------------------------------------------- known values

MIN_KNOWN_LEN = 6          # shorter values ("1", "true", "abc") are too common to replace wherever they appear


def secret_argv_values(argv: Sequence[Any]) -> list[str]:
    """The values of secret flags in an argv list: ``--api-key X``, ``--token=X``, ``HF_TOKEN=X``."""
    out: list[str] = []
    items = [str(a) for a in argv]
    for i, a in enumerate(items):
        if a.startswith("-"):
            name, eq, val = a.lstrip("-").partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(val)
                elif i + 1 < len(items) and not items[i + 1].startswith("-"):
                    out.append(items[i + 1])
            continue
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", a)
        if m and is_secret_name(m.group(1)):
            out.append(m.group(2))
    return out


def url_secret_values(text: str) -> list[str]:
    """Passwords of URLs (``scheme://user:PASSWORD@``) and values of secret query parameters in ``text``."""
    out = [m.group("pw") for m in URL_CREDENTIALS_RE.finditer(text)]
    for u in [*URL_RE.findall(text), *PATH_QUERY_RE.findall(text)]:
        out += [m.group("val") for m in QUERY_PARAM_RE.finditer(u) if _secret_query_name(m.group("name"))]
    return out


def known_secrets(*envs: Mapping[str, Any] | None, argv: Iterable[Any] = (), values: Iterable[Any] = (),
                  urls: Iterable[Any] = (), environ: bool = True) -> tuple[str, ...]:
    """The secret values to replace wherever they appear: values of secret-named variables of each mapping in
    ``envs`` (and of the process environment unless ``environ=False``), secret flag values of ``argv``, URL
    passwords and secret query values inside ``urls``, and ``values`` as given. Longest first; values shorter than
    :data:`MIN_KNOWN_LEN` are left to the patterns."""
    found: set[str] = set()
    maps = list(envs) + ([os.environ] if environ else [])
    for env in maps:
        for k, v in (env or {}).items():
            if is_secret_name(str(k)) and isinstance(v, (str, int, float)) and not isinstance(v, bool):
                found.add(str(v))
    found.update(secret_argv_values(list(argv)))
    for text in urls:
        found.update(url_secret_values(str(text)))
    found.update(str(v) for v in values if v is not None)
    keep = {v.strip() for v in found if len(v.strip()) >= MIN_KNOWN_LEN and _is_value(v.strip())}
    return tuple(sorted(keep, key=lambda v: (-len(v), v)))


@functools.lru_cache(maxsize=1)
def library_bundle() -> str:
    """The plotly.js bundle that every executed notebook and page embeds verbatim (4.8 MB of the library's own
    minified code, once per notebook and page): no run's secret can be in it, so the rules skip it — scanning it
    cost about 1.5 s per file and 5 s per phase run. Empty when plotly is not installed."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        return ""
    return get_plotlyjs()


def redact_text(text: str, known: Iterable[str] | None = None, names: bool = True) -> str:
    """``text`` with every known secret value (default: the process environment's) and everything that looks
    like a secret replaced by :data:`REDACTED` (``names=False`` for HTML/script: see :func:`redact_patterns`).
    The plotly.js bundle (:func:`library_bundle`) is kept as it is; the text around it is redacted."""
    text = str(text)
    bundle = library_bundle() if len(text) >= LIBRARY_BUNDLE_MIN else ""
    if bundle and bundle in text:
        known = tuple(known_secrets() if known is None else known)
        return bundle.join(redact_text(part, known, names) for part in text.split(bundle))
    for v in (known_secrets() if known is None else known):
        if v and v in text:
            text = text.replace(v, REDACTED)
    return redact_patterns(text, names)


def redact_html(text: str, known: Iterable[str] | None = None) -> str:
    """:func:`redact_text` for HTML and script (known values, shapes, URL credentials, headers)."""
    return redact_text(text, known, names=False)


def redact_env(env: Mapping[str, Any], known: Iterable[str] | None = None) -> dict[str, str]:
    """Values of secret-named variables hidden; every other value through :func:`redact_text`."""
    known = tuple(known_secrets(env) if known is None else known)
    return {k: (REDACTED if is_secret_name(k) and _is_value(str(v)) else redact_text(str(v), known))
            for k, v in env.items()}


def redact_argv(argv: Sequence[Any], known: Iterable[str] | None = None) -> list[str]:
    """Hide values of ``--api-key X``, ``--token=X``, ``KEY=secret`` style arguments (and known values)."""
    known = tuple(known_secrets(argv=argv) if known is None else known)
    out: list[str] = []
    hide_next = False
    for a in argv:
        a = str(a)
        if hide_next:
            hide_next = False
            if not a.startswith("-"):
                out.append(REDACTED)
                continue
        if a.startswith("-") and is_secret_name(a.lstrip("-").split("=", 1)[0]):
            if "=" in a:
                out.append(a.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(a)
                hide_next = True
            continue
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S*)$", a)
        if m and is_secret_name(m.group(1)):
            out.append(f"{m.group(1)}={REDACTED}")
            continue
        out.append(redact_text(a, known))          # a script (sh -c "...") keeps its words, loses its secrets
    return out


def redact(obj: Any, known: Iterable[str] | None = None) -> Any:
    """Recursively redact a JSON-like object: values under secret-named keys, argv-like string lists, known
    values and secret-looking strings anywhere."""
    known = tuple(known_secrets() if known is None else known)
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_name(k) and isinstance(v, (str, int, float))
                    and not isinstance(v, bool) and _is_value(str(v)) else redact(v, known))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if obj and all(isinstance(x, str) for x in obj):
            return redact_argv(list(obj), known)
        return [redact(x, known) for x in obj]
    if isinstance(obj, str):
        return redact_text(obj, known)
    return obj


# ---------------------------------------------------------------- files

TEXT_SUFFIXES = {".json", ".jsonl", ".csv", ".tsv", ".yaml", ".yml", ".txt", ".log", ".md", ".html", ".htm",
                 ".ipynb", ".out", ".err", ".py", ".sh", ".xml", ".svg", ".js", ".env", ".toml", ".cfg", ".ini", ""}
MAX_SCRUB_BYTES = 256 * 1024 * 1024  # beyond: left as it is (read whole into memory otherwise)
LARGE_BYTES = 16 * 1024 * 1024       # beyond: known values only (a trace is not parsed and searched by pattern)
LIBRARY_BUNDLE_MIN = 1024 * 1024     # only a text this long can hold the plotly.js bundle (library_bundle)


def is_text_file(path: Path) -> bool:
    return Path(path).suffix.lower() in TEXT_SUFFIXES


HTML_SUFFIXES = {".html", ".htm", ".svg", ".xml", ".js"}


def redact_bytes(data: bytes, known: Iterable[str] | None = None, names: bool = True) -> bytes:
    """A text file's bytes redacted (UTF-8; undecodable bytes kept as they are); binary data unchanged."""
    if b"\0" in data[:8192]:
        return data
    text = data.decode("utf-8", errors="surrogateescape")
    return redact_text(text, known, names).encode("utf-8", errors="surrogateescape")


# a superset of everything the rules can hit: a file without any of these (and without a known value) is left
# as it is without being parsed — requests.jsonl of a large case holds millions of numbers and no secret
SUSPECT_RE = re.compile(rb"(?i)secret|passw|credential|auth|(?:api|access|private|session|signing|encryption)"
                        rb"[_\-.]?key|bearer|"
                        rb"cookie|token(?![a-z])|pass(?![a-z])|://[^\s/]*@|[?&][\w.\-]*(?:key|sig|code)[\w.\-]*=|"
                        rb"\bhf_|\bsk-|\bgh[pousr]_|github_pat_|\bxox|AKIA|-----BEGIN")


def might_hold_secrets(data: bytes, known: Iterable[str] = ()) -> bool:
    """False when no rule of :func:`redact_text` can change ``data`` (and no known value is in it)."""
    return bool(SUSPECT_RE.search(data)) or any(v.encode() in data for v in known if v)


def redact_file_bytes(name: str, data: bytes, known: Iterable[str] | None = None) -> bytes:
    """The bytes of a file called ``name`` redacted as its kind needs: an executed notebook cell by cell, JSON as
    objects, HTML without the name rules, other text files in full, a text file over :data:`LARGE_BYTES` (a trace)
    by known value only, binary files (Parquet, images, compressed traces) unchanged."""
    suffix = Path(name).suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        return data
    known = tuple(known_secrets() if known is None else known)
    if not might_hold_secrets(data, known):
        return data
    if len(data) > LARGE_BYTES and suffix not in (".ipynb", ".html", ".htm"):   # a trace: known values only
        for v in known:
            data = data.replace(v.encode(), REDACTED.encode())
        return data
    if suffix == ".ipynb":
        try:
            nb = json.loads(data)
            before = json.loads(data)
            scrub_notebook_node(nb, known)
            if nb == before:
                return data
            return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
        except (ValueError, AttributeError, TypeError):
            pass
    if suffix in (".json", ".jsonl"):
        # data stays data: parsed and redacted as objects (keys, argv lists, strings), never as text
        try:
            text = data.decode("utf-8")
            if suffix == ".json":
                obj = json.loads(text)
                red = redact(obj, known)
                return data if red == obj else json.dumps(red, indent=2, ensure_ascii=False).encode()
            lines = text.splitlines(keepends=True)
            out = []
            for line in lines:
                if not line.strip():
                    out.append(line)
                    continue
                obj = json.loads(line)
                red = redact(obj, known)
                out.append(line if red == obj else json.dumps(red, ensure_ascii=False) + "\n")
            return "".join(out).encode()
        except (UnicodeDecodeError, ValueError):
            pass                  # not JSON after all (a partial line): as text
    return redact_bytes(data, known, names=suffix not in HTML_SUFFIXES)


def scrub_notebook_node(nb: Any, known: Iterable[str] | None = None) -> Any:
    """An (nbformat or plain-dict) notebook with sources, text and stream outputs, tracebacks, error values,
    every text-like display representation and the parameters redacted, in place."""
    known = tuple(known_secrets() if known is None else known)

    def red(v: Any, names: bool = True) -> Any:
        if isinstance(v, list):
            if sum(len(x) for x in v if isinstance(x, str)) >= LIBRARY_BUNDLE_MIN and all(isinstance(x, str) for x in v):
                # a multi-line output stored as lines: redacted whole, so that the bundle in it is found and kept
                return [ln for ln in re.split(r"(?<=\n)", redact_text("".join(v), known, names)) if ln]
            return [redact_text(x, known, names) if isinstance(x, str) else x for x in v]
        return redact_text(v, known, names) if isinstance(v, str) else v

    for cell in nb.get("cells", []):
        # a markdown cell is the library's own prose: known values and secret shapes go, but its words are never
        # taken for a secret's value ("should not change a single token: regression means it did")
        cell["source"] = red(cell.get("source", ""), names=cell.get("cell_type") != "markdown")
        for out in cell.get("outputs", []) or []:
            for key in ("text", "traceback", "evalue", "ename"):
                if key in out:
                    out[key] = red(out[key])
            data = out.get("data", {}) or {}
            for mime in list(data):
                if mime.startswith("text/") or mime in ("application/json", "application/javascript") \
                        or mime.endswith("+json"):
                    if isinstance(data[mime], (str, list)):
                        data[mime] = red(data[mime], names=mime in ("text/plain", "text/markdown", "text/latex"))
                    else:
                        data[mime] = redact(data[mime], known)
        if "metadata" in cell:
            cell["metadata"] = redact(cell["metadata"], known)
    if "metadata" in nb:
        nb["metadata"] = redact(nb["metadata"], known)
    return nb


def scrub_file(path: Path, known: Iterable[str] | None = None) -> bool:
    """Redact one text file in place (:func:`redact_file_bytes`); True when it changed."""
    path = Path(path)
    if not path.is_file() or not is_text_file(path):
        return False
    size = path.stat().st_size
    if size > MAX_SCRUB_BYTES:
        return False
    data = path.read_bytes()
    new = redact_file_bytes(path.name, data, known)
    if new == data:
        return False
    if path.suffix in (".log", ".out", ".err", ".jsonl"):
        # a log may still be open for appending (the kernel's, a collector's): rewrite the same file, whose
        # writer keeps appending at its end, rather than replace it with one the writer never sees
        with open(path, "r+b") as f:
            f.write(new)
            f.truncate()
    else:
        tmp = path.with_name(path.name + ".redact.tmp")
        tmp.write_bytes(new)
        os.replace(tmp, path)
    return True


def scrub_tree(root: Path, known: Iterable[str] | None = None, since: float | None = None,
               exclude: tuple[str, ...] = ()) -> list[Path]:
    """Redact every text file under ``root`` in place (binary files — traces, Parquet — untouched), only those
    modified at or after ``since`` (epoch seconds) when given, none whose name ends with one of ``exclude``;
    returns the files that changed."""
    known = tuple(known_secrets() if known is None else known)
    changed = []
    for f in sorted(Path(root).rglob("*")):
        try:
            if not f.is_file() or f.is_symlink() or not is_text_file(f) or f.name.endswith(exclude) \
                    or (since is not None and f.stat().st_mtime < since):
                continue
        except OSError:
            continue
        if scrub_file(f, known):
            changed.append(f)
    return changed
