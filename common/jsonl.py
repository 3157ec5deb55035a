"""The JSONL/JSON files stages exchange: strict reads (a bad line names its file and line), atomic writes."""

import contextlib
import json
import os
import shutil
import tempfile


class RecordError(Exception):
    """Bad input to a stage: the message names the file and, where known, the line."""


def read_jsonl(path, required=()):
    """All records of a JSONL file; each must be an object holding the `required` keys."""
    if not os.path.isfile(path):
        raise RecordError(f"{path}: no such file")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise RecordError(f"{path}:{lineno}: expected a JSON object")
            missing = [k for k in required if k not in rec]
            if missing:
                raise RecordError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
            rec["_line"] = lineno
            records.append(rec)
    return records


def read_json(path):
    if not os.path.isfile(path):
        raise RecordError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None


@contextlib.contextmanager
def atomic_open(path):
    """A text file handle whose content appears at `path` only if the block completes."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path) + "-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        os.chmod(tmp, 0o644)  # mkstemp makes files private; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_jsonl(path, records):
    with atomic_open(path) as f:
        for rec in records:
            f.write(json.dumps({k: v for k, v in rec.items() if k != "_line"}, ensure_ascii=False) + "\n")


def write_json(path, obj):
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


@contextlib.contextmanager
def atomic_dir(path):
    """A temporary folder that replaces `path` only if the block completes."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-" + os.path.basename(path) + "-")
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
