"""What a command writes: checked against everything it reads before any work, written all or nothing.

    inputs = Inputs().files(args.source, *model.source_files).folder(pipeline_root)
    outputs = Outputs(inputs)
    outputs.file(args.output, "-o")          # one-line OnnxoptError (exit 2) now, not after the work
    outputs.file(args.json, "--json")
    ...the work...
    with staged() as stage:                  # each file to a temporary beside it, then all renamed
        stage.write(args.output, image_writer)
        stage.text(args.json, report)

Aliases. A path can name an input without spelling it: through a symbolic link anywhere on its way
(``link/../x`` is the parent of the link's target, not ``x``), a hard link (another name of the
same file) or a bind mount (the same folder at another place). So a file is identified by
``(st_dev, st_ino)`` (``os.stat`` follows symbolic links), and "inside an input folder" means that
the output's real parent, or a folder above it, is that folder by the same identity.

Permissions: written files are ``0o666`` and folders ``0o777`` less the process umask, as any other
tool's (``mkstemp``/``mkdtemp`` alone make them owner-only).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from onnxopt.errors import ModelSaveError, OnnxoptError

Identity = tuple[int, int]


def identity(path: str | os.PathLike) -> Identity | None:
    """(st_dev, st_ino) of what ``path`` names, symbolic links followed; None when nothing is there."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _folder_of(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


class Inputs:
    """The files and folders a command reads, by identity."""

    def __init__(self) -> None:
        self._files: dict[Identity, Path] = {}
        self._folders: dict[Identity, Path] = {}

    def files(self, *paths) -> "Inputs":
        for path in filter(None, paths):
            if (ident := identity(path)) is not None:
                self._files.setdefault(ident, Path(path))
        return self

    def model(self, model) -> "Inputs":
        """A loaded model's files: the .onnx and every external data file (its companions' too)."""
        return self.files(*(p for m in [model, *model.companions.values()] for p in m.source_files))

    def folder(self, root) -> "Inputs":
        """A folder read as a whole (a pipeline folder): nothing may be written inside it, nor onto
        any of its files under another name."""
        if (ident := identity(root)) is not None:
            self._folders.setdefault(ident, Path(root))
            for dirpath, _, names in os.walk(root):
                self.files(*(Path(dirpath) / name for name in names))
        return self

    def alias(self, path) -> str | None:
        """Why writing ``path`` would write an input ("is X, a file this run reads"), or None."""
        path = Path(path)
        real = Path(os.path.realpath(path))
        for folder in (real, *real.parents):
            if (ident := identity(folder)) in self._folders:
                return f"is {'inside ' if folder != real else ''}the input folder {self._folders[ident]}"
        if (ident := identity(path)) in self._files:
            return f"is {self._files[ident]}, a file the input reads"
        return None

    def contained_in(self, folder) -> Path | None:
        """An input folder that lies inside (or is) ``folder``, by identity; None if none does."""
        target = identity(folder)
        for root in self._folders.values():
            real = Path(os.path.realpath(root))
            if any(identity(f) == target for f in (real, *real.parents)):
                return root
        return None


def _check_parent(path: Path) -> None:
    folder = _folder_of(path)
    if not folder.is_dir():
        raise ModelSaveError(f"{path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ModelSaveError(f"{path}: folder {folder} is not writable")
    # and a real write: root passes os.access everywhere, yet /proc or a read-only mount refuse the
    # file, and the run failed only at the end, after the work
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as exc:
        raise ModelSaveError(f"{path}: folder {folder} is not writable ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


class Outputs:
    """The outputs of one command, each checked when it is named (before any work)."""

    def __init__(self, inputs: Inputs | None = None) -> None:
        self.inputs = inputs or Inputs()
        self.planned: list[tuple[Path, str]] = []

    def _refuse_alias(self, path: Path, flag: str) -> None:
        if (why := self.inputs.alias(path)) is not None:
            raise ModelSaveError(f"{path}: {flag} {why}; onnxopt never modifies its input")
        real, ident = os.path.realpath(path), identity(path)
        for other, other_flag in self.planned:
            if os.path.realpath(other) == real or (ident is not None and identity(other) == ident):
                raise ModelSaveError(f"{path}: would be written twice ({flag} and {other_flag}); give each output its own path")

    def file(self, path, flag: str = "the output") -> Path:
        """A file to write (replaced if it exists): refused when it is a folder, its folder is
        missing or not writable, or it is an input or another output under any name."""
        path = Path(path)
        if path.is_dir():
            raise ModelSaveError(f"{path}: is a folder, not a file ({flag})")
        _check_parent(path)
        self._refuse_alias(path, flag)
        self.planned.append((path, flag))
        return path

    def folder(self, path, flag: str = "the output folder") -> Path:
        """A new folder: absent, or an empty folder (a symbolic link to one: the folder it names,
        which is where the result goes). Returns the path to build it at."""
        path = Path(path)
        if path.is_symlink() and path.is_dir():
            path = Path(os.path.realpath(path))
        if (inside := self.inputs.contained_in(path)) is not None:
            raise ModelSaveError(f"{path}: {flag} may not be the input folder or contain it ({inside})")
        if (why := self.inputs.alias(path)) is not None:
            raise ModelSaveError(f"{path}: {flag} {why}; onnxopt never modifies its input")
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ModelSaveError(f"{path}: exists and is not an empty folder; onnxopt does not overwrite folders")
        _check_parent(path)
        self._refuse_alias(path, flag)
        self.planned.append((path, flag))
        return path


# ----------------------------------------------------------------------------------- writing


def umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def temp_beside(path: Path) -> Path:
    """An empty temporary file in ``path``'s folder, with the permissions a new file gets."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=_folder_of(path))
    os.close(fd)
    os.chmod(name, 0o666 & ~umask())  # mkstemp makes 0600 files
    return Path(name)


def temp_folder_beside(path: Path) -> Path:
    """An empty temporary folder beside ``path``, with the permissions a new folder gets."""
    name = tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=_folder_of(path))
    os.chmod(name, 0o777 & ~umask())  # mkdtemp makes 0700 folders
    return Path(name)


class Stage:
    """Files written to temporaries beside their destinations; :meth:`commit` renames them all."""

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary, destination)

    def write(self, path, writer: Callable[[BinaryIO], None]) -> None:
        path = Path(path)
        try:
            tmp = temp_beside(path)
            self._pending.append((tmp, path))
            with open(tmp, "wb") as out:
                writer(out)
        except OSError as exc:
            raise OnnxoptError(f"{path}: cannot write: {exc.strerror or exc}") from exc

    def text(self, path, text: str) -> None:
        self.write(path, lambda out: out.write(text.encode()))

    def commit(self) -> None:
        done: list[Path] = []
        try:
            for tmp, path in self._pending:
                os.replace(tmp, path)
                done.append(path)
        except OSError as exc:
            for path in done:  # all or nothing: what was renamed already goes again
                path.unlink(missing_ok=True)
            raise OnnxoptError(f"{path}: cannot write: {exc.strerror or exc}") from exc
        self._pending = []

    def discard(self) -> None:
        for tmp, _ in self._pending:
            tmp.unlink(missing_ok=True)
        self._pending = []


@contextlib.contextmanager
def staged() -> Iterator[Stage]:
    """A :class:`Stage` committed when the block ends, discarded (nothing written) when it raises."""
    stage = Stage()
    try:
        yield stage
        stage.commit()
    finally:
        stage.discard()
