"""The sampler's planning, in numpy only (``shardfs.torch`` is the torch-facing sampler).

``plan``: what an epoch draws, whatever the world, and how a world of nodes and ranks deals it;
``state``: what a resume point holds and the checks that it belongs to the same run.
"""
