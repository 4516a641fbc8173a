"""Token trees: shapes as lists of paths turned into masks once (``shapes``), and their size for the host they run
on (``hardware``)."""
