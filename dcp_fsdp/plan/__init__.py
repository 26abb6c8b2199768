"""`dcp-fsdp plan`: DCP's own save plan for a world you do not have, built in one process.

state.py synthesises each rank's local plan (FSDP2 dim-0 sharding of the preset's state),
build.py runs DCP's planner over them and lays out the objects and `.metadata` a save
writes, requests.py turns those into S3 requests, prefix rates and projected times, and
render.py prints them. Pure: no ranks, no storage I/O.
"""
