"""The device mesh as one composition, torchtitan's shape: `mesh.Parallelism` holds every fact of this
rank's place on the mesh, `parallelize.parallelize` applies tensor and context parallelism, the
pipeline split and FSDP2 sharding to a loaded model and fills it from the loading rank(s), and
`runner` runs its steps (micro-batch after micro-batch, or the pipeline's schedule). `FSDPStrategy`
builds the three and delegates to them."""
