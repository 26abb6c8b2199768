"""`dcp-fsdp plan`: DCP's own save plan for a world you do not have, built in one process.

state.py synthesises each rank's local plan (FSDP2 dim-0 sharding of the preset's state),
build.py runs DCP's planner over them and lays out the objects and `.metadata` a save
writes, sample.py builds large worlds from a subset of the layers, requests.py turns objects
into S3 requests, prefix rates and projected times, measured.py reads a record's per-rank
rates, render.py prints, command.py parses the command line. Pure: no ranks, no storage I/O
(docs/plan.md).
"""
