"""Fault injection for kvswarm's own fault suite (tests/faults/) and ``kvswarm bench faults``.

One set of injectors serves both: crashes of a writer process (kill -9 at random or at a named
operation, :mod:`.writer`), power cuts (an ext4 shut down without flushing its log, :mod:`.loopfs`),
damaged bytes in every on-disk structure (:mod:`.corrupt`), full and failing file systems and block
devices, thread and follower races, and bad arguments to the API and the CLI (:mod:`.inputs`).
:mod:`.campaign` runs them and counts outcomes (:mod:`.outcome`); risky calls run in a
:class:`~.sandbox.Sandbox` process, so a hang is a counted timeout, not a stuck campaign.
"""
