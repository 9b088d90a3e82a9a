"""The manifest: which upstream files the overlay replaces, and the torch releases (bases) it serves.

``manifest.json`` is the single source of truth for the bases. For each supported release it records the
sha256 of every replaced upstream file; the releases are ordered oldest first, and the newest is the one the
payload (``torch_overlay/torch/...``) and the upstream series are made on. The start-up hook (through the
finder), the loader, the version guard, fork mode and the patch tools all read it here, and nothing else in
the project spells out a path, a module name, a version or a hash of a base.

NOTE: this is the leaf of the package's imports, and the start-up hook of a persistent install loads it into
every interpreter of the environment: it imports only what a bare interpreter has already loaded (plus
``json``), so no dataclasses or typing here.
"""

from __future__ import annotations

import json
import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
MANIFEST_PATH = os.path.join(PACKAGE_DIR, "manifest.json")
BASES_DIR = "bases"
"""The per-base payloads, inside this package: ``bases/<version>/torch/...``."""


class OverlayModule:
    """One upstream module that the overlay replaces as a whole file, or a new module it adds."""

    __slots__ = (
        "name",
        "path",
        "runtime",
        "code_sha256",
        "new",
        "base_payloads",
        "keep_classes",
        "refuse_live_instances",
    )

    def __init__(
        self,
        name: str,
        path: str,
        runtime: bool = True,
        code_sha256: str | None = None,
        new: bool = False,
        base_payloads: tuple[str, ...] = (),
        keep_classes: bool = False,
        refuse_live_instances: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        """Dotted module name, e.g. ``torch.distributed.fsdp._unshard_param_utils``."""
        self.path = path
        """POSIX path relative to a PyTorch checkout or to site-packages, e.g. ``torch/distributed/...py``."""
        self.runtime = runtime
        """Served by the runtime overlay. False for a file changed only in its docstrings whose module defines
        classes that live objects are instances of (``FullyShardedDataParallel``): serving a new copy at run
        time would break ``isinstance`` for every model built before activation, for a change no program can
        observe. Such a file is still checked by the guard, patched by fork mode and carried by the series."""
        self.code_sha256 = code_sha256
        """The claim that every base's upstream file of this module has this :func:`code_sha256` (the same code,
        comments aside), or None. It lets the one payload serve a runtime file whose bases differ only in
        comments; the guard still checks each base's exact sha256, and the sync check (``tools.check``) verifies
        the claim on every base's pristine file (those served by the payload, see ``base_payloads``)."""
        self.new = new
        """A module with no upstream counterpart (a private helper a replaced file imports): no base ships the
        file, which every base records as ``null`` (absent), so the guard refuses a torch that has one. The
        runtime overlay serves it like the others, fork mode creates it (and removes it on revert), and the
        series adds it as a new file."""
        self.base_payloads = base_payloads
        """The bases whose upstream file of this runtime module differs in code from the payload base's: each
        has its own payload, our change transplanted onto its file (``tools.transplant``), at
        :meth:`base_payload_file`. One per distinct upstream file, named by the oldest base that ships it; every
        base with that file is served it."""
        self.keep_classes = keep_classes
        """Served with the stock module's classes: for a file whose classes or enums other modules hold (in dicts,
        ``isinstance`` checks, defaults), such as FSDP's ``_flat_param.py``. Each class the stock module defines
        stays the stock object, with the overlay's class body installed on it (see :mod:`torch_overlay._graft`)."""
        self.refuse_live_instances = refuse_live_instances
        """With ``keep_classes``, the classes (top-level names) whose objects work only with the version that built
        them (DDP: the overlay's ``__init__`` builds the reducer over the DTensor parameters' local tensors, which
        its methods expect): activation and deactivation refuse while one is alive, rather than run the other
        version's methods on it."""

    def __repr__(self) -> str:
        return f"OverlayModule({self.name!r}, runtime={self.runtime}{', new=True' if self.new else ''})"

    @property
    def overlay_file(self) -> str:
        """Our version of the file, inside this package (``torch_overlay/torch/...``)."""
        return os.path.join(PACKAGE_DIR, *self.path.split("/"))

    def base_payload_file(self, version: str) -> str:
        """The payload of the bases that ship ``version``'s upstream file (one of :attr:`base_payloads`)."""
        return os.path.join(PACKAGE_DIR, BASES_DIR, version, *self.path.split("/"))

    @property
    def payload_files(self) -> tuple[str, ...]:
        """Every file this package may serve for the module: :attr:`overlay_file`, then the per-base ones."""
        return (self.overlay_file, *(self.base_payload_file(v) for v in self.base_payloads))

    def upstream_file(self, torch_dir: os.PathLike[str] | str) -> str:
        """The upstream file inside an installed ``torch`` package directory."""
        return os.path.join(os.path.dirname(os.fspath(torch_dir)), *self.path.split("/"))


class Base:
    """One supported torch release: its public version and the sha256 of each replaced upstream file."""

    __slots__ = ("version", "sha256")

    def __init__(self, version: str, sha256: dict[str, str | None]) -> None:
        self.version = version
        self.sha256 = sha256
        """Manifest path -> sha256 of that release's upstream file; None for a new module (the file is absent)."""

    @property
    def upstream(self) -> dict[str, str]:
        """The paths this release ships -> their sha256 (every manifest path but the new modules')."""
        return {p: h for p, h in self.sha256.items() if h is not None}

    def __repr__(self) -> str:
        return f"Base({self.version!r})"


class Manifest:
    """The replaced modules, in dependency order, and the bases, oldest first."""

    __slots__ = ("package", "modules", "bases")

    def __init__(self, package: str, modules: tuple[OverlayModule, ...], bases: tuple[Base, ...]) -> None:
        self.package = package
        self.modules = modules
        self.bases = bases

    def module(self, name: str) -> OverlayModule | None:
        return next((m for m in self.modules if m.name == name), None)

    @property
    def runtime_modules(self) -> tuple[OverlayModule, ...]:
        """The modules the runtime overlay serves (see :attr:`OverlayModule.runtime`)."""
        return tuple(m for m in self.modules if m.runtime)

    @property
    def new_modules(self) -> tuple[OverlayModule, ...]:
        """The modules with no upstream counterpart (see :attr:`OverlayModule.new`)."""
        return tuple(m for m in self.modules if m.new)

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(b.version for b in self.bases)

    @property
    def payload_base(self) -> Base:
        """The newest base: the payload and the upstream series are this release's files plus our change."""
        return self.bases[-1]

    def base(self, version: str | None) -> Base | None:
        """The listed base of that version (a local tag such as ``+cpu`` is ignored), or None."""
        public = public_version(version) if version else None
        return next((b for b in self.bases if b.version == public), None)

    def bases_with_files(self, found: dict[str, str | None]) -> list[Base]:
        """The bases whose every replaced file has the sha256 in ``found`` (path -> sha256), newest first."""
        return [b for b in reversed(self.bases) if all(found.get(p) == h for p, h in b.sha256.items())]

    def payload_version(self, module: OverlayModule, base: Base) -> str | None:
        """Which of the module's :attr:`~OverlayModule.base_payloads` serves ``base``; None: the payload."""
        sha = base.sha256.get(module.path)
        if sha == self.payload_base.sha256.get(module.path):
            return None
        return next((v for v in module.base_payloads if self.base(v).sha256.get(module.path) == sha), None)

    def payload_file(self, module: OverlayModule, base: Base) -> str:
        """The file that serves ``module`` on ``base``."""
        version = self.payload_version(module, base)
        return module.overlay_file if version is None else module.base_payload_file(version)

    def overlay_files(self, base: Base) -> dict[str, str]:
        """Module name -> our file for ``base``, for the modules served at run time, in dependency order."""
        return {m.name: self.payload_file(m, base) for m in self.runtime_modules}


_cache: dict[tuple[str, int, int], Manifest] = {}


def load_manifest(path: str | os.PathLike[str] = MANIFEST_PATH) -> Manifest:
    """Read and validate ``manifest.json`` (once per version of the file); a malformed one is a bug, said plainly."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
    except OSError:
        key = (path, 0, 0)
    if key not in _cache:
        _cache[key] = _read(path)
    return _cache[key]


def _read(path: str) -> Manifest:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        modules = tuple(
            OverlayModule(
                m["name"],
                m["path"],
                m.get("runtime", True),
                m.get("code_sha256"),
                m.get("new", False),
                tuple(m.get("base_payloads", ())),
                m.get("keep_classes", False),
                tuple(m.get("refuse_live_instances", ())),
            )
            for m in raw["modules"]
        )
        bases = tuple(Base(b["version"], dict(b["sha256"])) for b in raw["bases"])
        manifest = Manifest(raw["package"], modules, bases)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"torch_overlay: cannot read the manifest {path}: {e!r}") from e
    problems = []
    for m in modules:
        expected = m.name.replace(".", "/") + ".py"
        if m.path != expected:
            problems.append(f"module {m.name} has path {m.path}, expected {expected}")
        if m.code_sha256 is not None and not _is_sha256(m.code_sha256):
            problems.append(f"module {m.name} has code_sha256 {m.code_sha256!r}, not a sha256 (64 hex digits)")
    paths = {m.path for m in modules}
    if not bases:
        problems.append("no bases")
    keys = [version_key(b.version) for b in bases]
    if keys != sorted(set(keys)):
        problems.append(f"bases {[b.version for b in bases]} are not unique and oldest first")
    for b in bases:
        if set(b.sha256) != paths:
            problems.append(f"base {b.version} records {sorted(b.sha256)}, not the modules' paths {sorted(paths)}")
        for m in modules:
            if m.path in b.sha256 and (b.sha256[m.path] is None) != m.new:
                what = "null (a new module: no release ships it)" if m.new else "its upstream file's sha256"
                problems.append(f"base {b.version}: {m.path} must be recorded as {what}")
    if not problems:
        for m in modules:
            problems += _payload_problems(manifest, m)
    if problems:
        raise RuntimeError(f"torch_overlay: invalid manifest {path}: " + "; ".join(problems))
    return manifest


def _payload_problems(manifest: Manifest, m: OverlayModule) -> list[str]:
    """Where a module's payloads do not serve every base: one line each (empty when they do).

    NOTE: a runtime file is served on a base from the payload when the base's upstream file is the one the
    payload was made from, or differs from it only in comments (the module's code_sha256, which the sync check
    verifies); otherwise from the base's own payload (``base_payloads``). Docstring-only files need neither: fork
    mode and the series patch each base's own file.
    """
    problems = []
    newest = manifest.payload_base
    own = {}
    for version in m.base_payloads:
        base = manifest.base(version)
        if base is None or base is newest:
            problems.append(f"module {m.name}: base_payloads lists {version}, not a base older than {newest.version}")
            continue
        sha = base.sha256[m.path]
        oldest = next(b for b in manifest.bases if b.sha256[m.path] == sha)
        if sha == newest.sha256[m.path] or sha in own or oldest is not base:
            problems.append(
                f"module {m.name}: base_payloads lists {version}, but the payload of torch {oldest.version}'s file "
                "is the payload itself, or is listed under another version; list each distinct file once, by the "
                "oldest base that ships it"
            )
        own[sha] = version
    if not m.runtime:
        if m.base_payloads:
            problems.append(f"module {m.name}: base_payloads for a docstring-only module (not served at run time)")
        return problems
    for b in manifest.bases:
        if b.sha256[m.path] != newest.sha256[m.path] and b.sha256[m.path] not in own and m.code_sha256 is None:
            problems.append(
                f"base {b.version}: runtime file {m.path} differs from the payload base {newest.version}'s and has "
                'no payload of its own: list the base in the module\'s "base_payloads" (`make rebase` does, '
                "`make patches` writes the file; `make check` verifies it), or, if they differ only in comments, "
                'record their code digest as its "code_sha256"'
            )
    return problems


def public_version(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13.0``: the local build tag names the wheel flavour, not the source."""
    return version.split("+", 1)[0]


def version_key(version: str) -> tuple[int, ...]:
    """``2.14.1+cu130`` -> ``(2, 14, 1)``, for ordering releases; a pre-release sorts as its release."""
    key = []
    for part in public_version(version).split("."):
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        key.append(int(digits or 0))
    return tuple(key)


def sha256_hex(content: bytes) -> str:
    """The hash the manifest records for an upstream file with ``content``."""
    import hashlib  # here, not at start-up

    return hashlib.sha256(content).hexdigest()


def code_sha256(content: bytes) -> str:
    """The sha256 of the code of a Python file with ``content``: its token stream without comments.

    Two files that differ only in comments or in layout within the code (blank lines, spaces between tokens,
    line breaks inside brackets) have the same digest; any other difference, in a docstring, a string or the
    indentation included, gives another. Only each token's type name and text are hashed, so the digest is the
    same on every Python version: an f-string, which Python 3.12+ splits into parts, counts as one string token
    of its source text, as earlier versions give it.
    Raises ``SyntaxError`` or ``tokenize.TokenError`` for content that does not tokenize.
    """
    import hashlib  # here, not at start-up
    import io
    import tokenize

    encoding, _ = tokenize.detect_encoding(io.BytesIO(content).readline)
    lines = io.StringIO(content.decode(encoding)).readlines()
    stream, fstring_start, depth = [], (0, 0), 0
    for tok in tokenize.tokenize(io.BytesIO(content).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":
            fstring_start = tok.start if depth == 0 else fstring_start
            depth += 1
        elif name == "FSTRING_END":
            depth -= 1
            if depth == 0:
                stream.append(("STRING", _source_text(lines, fstring_start, tok.end)))
        elif depth == 0 and name not in ("COMMENT", "NL"):
            stream.append((name, tok.string))
    return hashlib.sha256(json.dumps(stream).encode("utf-8")).hexdigest()


def _source_text(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    """The source between two tokenize positions (1-based rows, 0-based columns)."""
    if start[0] == end[0]:
        return lines[start[0] - 1][start[1] : end[1]]
    middle = lines[start[0] : end[0] - 1]
    return "".join([lines[start[0] - 1][start[1] :], *middle, lines[end[0] - 1][: end[1]]])


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def sha256_of(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return sha256_hex(f.read())


def hash_mismatches(expected: dict[str, str | None], found: dict[str, str | None]) -> list[str]:
    """One line per file whose sha256 in ``found`` (None: missing) is not the ``expected`` one (None: absent)."""
    lines = []
    for path, want in expected.items():
        got = found.get(path)
        if want is None:
            if got is not None:
                lines.append(
                    f"{path}: present (sha256 {got}), expected absent: the overlay adds this module, and this torch "
                    "ships its own"
                )
        elif got is None:
            lines.append(f"{path}: missing (expected sha256 {want})")
        elif got != want:
            lines.append(f"{path}: sha256 {got}, expected {want}")
    return lines
