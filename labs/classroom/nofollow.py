"""A kit's files read and written by the grader without following a link, and with a bound.

A kit (as handed in, or its sandbox's copy after a run) is the student's: any name in it may
be a symbolic link to the grader's files or another kit's, a FIFO that blocks a reader for
ever, a device, or a sparse file of 40 GiB. The grader runs as root, so a link it followed
would reach anything. Here every name below the kit's folder is opened one component at a
time, relative to the folder above it (openat), with O_NOFOLLOW: a link anywhere on the way
is refused, never resolved. A file is looked at (fstatat, no follow) before it is opened, so a
FIFO or a device is never opened at all, and it is read up to a bound, never by its size.

The kit's own folder (the path the instructor named) may itself be reached through links:
only what lies below it is the student's.
"""
import errno
import os
import stat
from pathlib import PurePosixPath

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(OSError):
    """A kit's name the grader does not read or write: its reason, in words for a student."""


def _parts(rel):
    rel = PurePosixPath(rel)
    if rel.is_absolute() or not rel.parts or any(p in ("..", ".") for p in rel.parts):
        raise Refused(errno.EINVAL, f"{rel} is not a name inside the kit")
    return rel.parts


def _what(mode):
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def open_dir(root, rel=None, create=False):
    """A descriptor of the folder root/rel, no link below root followed (create: made where
    absent). Raises Refused when a name on the way is a link or not a folder."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in _parts(rel) if rel else ():
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, _DIR, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                    raise Refused(err.errno, f"{part} is {_what(mode)}, not a folder") from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(root, rel):
    """(descriptor, stat) of the regular file root/rel, no link below root followed, a FIFO
    or device never opened; raises Refused (why, for a student) or FileNotFoundError."""
    parts = _parts(rel)
    shown = PurePosixPath(rel)
    try:
        folder = open_dir(root, "/".join(parts[:-1])) if len(parts) > 1 else open_dir(root)
    except Refused as err:
        raise Refused(err.errno, f"{shown} is not read: {err.strerror}") from None
    try:
        st = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(errno.EINVAL, f"{shown} is {_what(st.st_mode)}")
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                     dir_fd=folder)
    finally:
        os.close(folder)
    again = os.fstat(fd)
    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(again.st_mode):
        os.close(fd)
        raise Refused(errno.EAGAIN, f"{shown} changed while it was read")
    return fd, again


def _read_fd(fd, count):
    chunks, left = [], count
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read(root, rel, limit, part=None):
    """(bytes, "") of the regular file root/rel; (None, why) when it is absent, a link (or
    below one), not a regular file, or larger than `limit` bytes. part="head" or "tail": at
    most `limit` bytes of its beginning or its end instead, whatever its size."""
    shown = PurePosixPath(rel)
    try:
        fd, st = open_file(root, rel)
    except Refused as err:
        return None, err.strerror
    except FileNotFoundError:
        return None, f"{shown} is missing"
    except OSError as err:
        return None, f"{shown} cannot be read ({os.strerror(err.errno)})"
    try:
        if part is None and st.st_size > limit:
            return None, f"{shown} is larger than {limit} bytes"
        if part == "tail" and st.st_size > limit:
            os.lseek(fd, st.st_size - limit, os.SEEK_SET)
        data = _read_fd(fd, limit + (part is None))
        if len(data) > limit:
            return None, f"{shown} is larger than {limit} bytes"
        return data, ""
    finally:
        os.close(fd)


def read_path(path, limit, part=None):
    """read() of a file whose folder the grader made: only its last name is not followed."""
    path = PurePosixPath(path)
    return read(str(path.parent), path.name, limit, part)


def listdir(root, rel=None):
    """[(name, mode)] of the folder root/rel, modes as lstat gives them (no link followed);
    [] when it is absent or not a folder."""
    try:
        fd = open_dir(root, rel)
    except (Refused, OSError):
        return []
    try:
        found = []
        for name in os.listdir(fd):
            try:
                found.append((name, os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode))
            except OSError:
                continue
        return sorted(found)
    finally:
        os.close(fd)


def replace_folder(root, rel):
    """A descriptor of the folder root/rel, made fresh when a link or a file held its name (the
    link removed, never followed): the grader's own folder inside a kit (runs/grader-np2)."""
    parts = _parts(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(part, dir_fd=fd)          # the link itself, or a file
                    raise FileNotFoundError
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
            child = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_at(folder, name, data):
    """Write `data` as folder's file `name` (a descriptor from replace_folder): whatever held
    the name (a link included) is removed first, and the new file is made, never opened
    through a link."""
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise Refused(errno.EISDIR, f"{name} is a folder")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                 dir_fd=folder)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
