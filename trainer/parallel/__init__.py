"""One module per parallel dimension (data, tensor, pipeline, context, expert) plus the mesh, applied from outside
to a plain model (parallelize.py calls them in a fixed order). Floor 2: may import base/ and model/."""
