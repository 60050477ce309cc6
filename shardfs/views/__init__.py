"""Views: how index members become the presented tree, materialised once into SQLite.

- ``view``: building a view (raw or imagefolder) and ``View``, its lookups and listings;
- ``tree``: the tree a build writes: entries staged, duplicates resolved and reported;
- ``imagefolder``: the ImageFolder layout, ``CLASS/KEY.ext`` from webdataset samples;
- ``symlinks``: symlinks judged on the finished tree, as the kernel would walk them;
- ``nodes``: one presented entry (``Node``) and the mode ``stat`` shows for it.
"""
