"""`engine serve --record-trace FILE`: one JSONL line per finished request, {"timestamp": arrival
in seconds since the server started, "input_len": prompt tokens, "output_len": output tokens},
appended by a background thread (the engine thread only queues a tuple per finished request).
`engine bench --dataset-name trace --dataset-path FILE` replays it."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time

logger = logging.getLogger("engine.server")
_STOP = object()


class TraceRecorder:
    def __init__(self, path: str):
        self.path = path
        self.start = time.monotonic()  # Req.created is on the same clock
        self._file = open(path, "a", encoding="utf-8")  # fails at start-up, not mid-run
        self._rows: queue.SimpleQueue = queue.SimpleQueue()
        self._broken = False  # a write failed: stop queueing lines nobody will write
        self._thread = threading.Thread(target=self._write, name="trace-writer", daemon=True)
        self._thread.start()

    def record(self, req) -> None:
        """A finished request (engine thread): queue its line; aborted ones are not traffic
        the engine served, so they are left out."""
        if req.finish_reason != "abort" and not self._broken:
            self._rows.put((req.created - self.start, len(req.prompt_ids), len(req.output_ids)))

    def _write(self) -> None:
        while (row := self._rows.get()) is not _STOP:
            try:
                self._file.write(json.dumps({"timestamp": round(row[0], 6), "input_len": row[1],
                                             "output_len": row[2]}) + "\n")
                self._file.flush()
            except OSError as e:  # a full disk should not take the server down
                logger.error(f"--record-trace {self.path}: cannot write ({e}); no more lines")
                self._broken = True
                return

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then close the file."""
        self._rows.put(_STOP)
        self._thread.join(timeout)
        self._file.close()
