"""Console output that outlives its reader: `python train_sft.py | tee log` and Ctrl-C kills tee with the run, and the
next write to the pipe raises BrokenPipeError wherever it happens (the progress bar, the signal's own line), which
would end the run before its checkpoint. A closed stdout/stderr ends the console output, never the run or its save:
the stream's file descriptor is pointed at /dev/null and the write is done again there. The rank logs (files) keep
every line."""
import errno
import os
import sys

GONE = (errno.EPIPE, errno.EIO, errno.EBADF, errno.ECONNRESET)  # the reader left, the terminal hung up, fd closed


class SurvivingStream:
    """A text stream (sys.stdout/sys.stderr) whose writes and flushes never raise once its reader is gone."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            self._to_devnull(e)
            return self._stream.write(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._to_devnull(e)
            self._stream.flush()  # the buffered bytes now go to /dev/null

    def _to_devnull(self, error):
        if error.errno not in GONE:
            raise error
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())  # every holder of the descriptor (C code, children) follows
        finally:
            os.close(devnull)

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self._stream, name)


def survive_closed_output():
    """Wrap sys.stdout and sys.stderr (once); a stream that is None (its descriptor closed at start) writes nowhere."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            stream = open(os.devnull, "w")
        if not isinstance(stream, SurvivingStream):
            setattr(sys, name, SurvivingStream(stream))


def write_fd(fd, text):
    """os.write to a descriptor whose reader may have left (a signal handler's last resort): dropped then."""
    try:
        os.write(fd, text.encode())
    except OSError as e:
        if e.errno not in GONE:
            raise
