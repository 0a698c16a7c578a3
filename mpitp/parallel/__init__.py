"""The parallel world: MPI ranks, the dp x pp x tp layout, MPI collectives with deadlines, the torch world of one
model replica, devices and stop signals."""
