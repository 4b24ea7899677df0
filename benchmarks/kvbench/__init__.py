"""kvbench: ``kvctl bench`` and the harness the programs in ``benchmarks/`` share.

``kvctl bench``: data-path speed of kvstored beside its physical and transport limits.

A program, not a test. It measures put, get and lookup of KV blocks against a running
daemon (``kvctl --addr ADDR bench``) or one it starts itself in a temp dir (and stops),
and, in the same run and on the same bytes, three baselines:

- memcpy: ``np.copyto`` of each call's bytes into a reused buffer, one thread -- the
  physical limit of moving the bytes at all;
- two floors beside it, for the cases where kvstore cannot use a reused buffer:
  ``stream`` copies each call's bytes into fresh memory (distinct destinations over a
  ring larger than the cache, with kvstore's streaming copy), what a put must do to
  land bytes in arena slots; ``pread`` reads each call's bytes from a file in the
  page cache (one ``preadv`` per call, next to the disk tier's file), what a warm disk
  hit must do;
- grpc raw: an asyncio gRPC server like kvstored's, on a unix socket, with generic
  handlers and identity (de)serializers: ``Pull`` streams N bytes to the client (like
  an inline Get), ``Push`` takes N bytes (like an inline Put), ``Echo`` sends them
  back in one message -- the transport limit of the inline path;
- redis: a real ``redis-server`` on its unix socket, started and stopped here, driven
  by redis-py with the hiredis reply parser and the Python command packer (it sends
  large values as separate buffers, without joining them): ``MSET`` / ``MGET`` of the
  same blocks per call (skipped when ``redis-server`` or redis-py is missing).

Cases: layouts (a tiny model and Llama-3-8B-shaped bf16 blocks of 2 / 8 / 16 / 64
tokens, 128 KiB per token) x batches (blocks per call) x paths (shared arena,
inline) x tiers (host hit, disk hit with the page cache warm and cold, miss). Every
case runs ``repeat`` timed passes over its chains after one untimed warm-up pass;
throughput is the best pass, latency percentiles are over every timed call. Each
pass is bounded in calls, blocks and bytes, so the default run takes a few minutes.

Disk cases need a daemon this program started: it writes their chains, restarts
the daemon (which persists the host tier and comes back with every block on disk
only) and refills the arena's pages once (a fresh arena costs ~1 ms/MiB to fault in
on the VMs we use, a one-off that is not the steady state). A disk hit changes what it
reads (a prefix read twice is promoted), so each pass reads chains of its own. The
warm cases take their passes in turns with memcpy and the pread floor, after one
restart for all of them; the LMDB file is read whole first and again every
WARM_EVERY_S, so that the page cache holds it (the VMs we use page out memory left
idle for 60 s). For the cold cases, one pass each, the daemon is restarted again and
the page cache dropped (``/proc/sys/vm/drop_caches`` and ``posix_fadvise(DONTNEED)``
on the LMDB file) when allowed. Against ``--addr`` they are skipped.

Outputs: a table on stdout, ``--json PATH`` (every result), ``--report PATH.md``
(tables with ratios to memcpy, grpc raw and Redis, the targets, a PNG plot beside it;
only the part between the ``bench:begin``/``bench:end`` markers is replaced when the
file exists). Progress goes to stderr.

    kvctl bench [--quick] [--report docs/benchmarks/datapath.md] [--json out.json]
    python -m kvbench ...               (the same)
"""

