"""`dcp-fsdp plan`: DCP's own save plan for a world you do not have, built in one process
with no ranks and no storage I/O (docs/plan.md)."""
