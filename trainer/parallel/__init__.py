"""One module per parallel dimension (data, tensor, pipeline, context) plus the mesh, applied from outside to a
plain model (parallelize.py calls them in a fixed order). May import runtime/launch.py's collectives and model/;
never core/, stages/, rl/ or an entry script."""
