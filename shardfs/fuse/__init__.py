"""The FUSE side: the libfuse binding (``binding``), the operations adapter from kernel
requests onto the filesystem core (``operations``), listings in the kernel's wire format
(``dirents``), pushes of cached files into the kernel's page cache (``pushes``, with
``edges`` putting together files that straddle blocks), the compiled path for hot
requests (``hot_path``) and the session that mounts and serves (``session``). Only this
package imports the binding; the core it adapts knows nothing of FUSE."""
