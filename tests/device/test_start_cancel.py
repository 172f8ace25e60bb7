"""A start-up cancel does not wait for the device processes to load: `--pp 2` starts one per stage, each of
which reads no quit until its weights are in, so a SIGTERM during start-up used to wait for every stage to load
(5.4 s at 3 s into the start). ProcessExecutor.shutdown before wait_ready now stops them at once: each ends by
the SIGTERM it was sent, not by a quit it read after loading nor by the kill after the 10 s wait."""
from __future__ import annotations

import signal

from tandem.config import EngineConfig
from tandem.device.process.executor import ProcessExecutor
from tandem.device.ranks import runner_spec
from tandem.model.loader import resolve_model
from tests.helpers.tiny_models import make_tiny_model


def test_shutdown_during_start_up_stops_every_stage_at_once(tmp_path):
    model = make_tiny_model(tmp_path, "llama", num_hidden_layers=2)
    config = EngineConfig(model=model, pp_size=2, kv_cache_tokens=1024, device_threads=1)
    ex = ProcessExecutor(runner_spec(config, resolve_model(model, config.cache_dir)), 1, 256)
    procs = [ex.proc, *ex.ranks]
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    ex.shutdown()                                   # as a SIGTERM in wait_ready does (Engine's except)
    assert [p.returncode for p in procs] == [-signal.SIGTERM] * 2
