"""Who may talk to a kvtier server: secrets, the CurveZMQ keys derived from them, tenants, and ZAP.

Trust boundary: processes of other OS users on the host, and network peers when a port is bound beyond
loopback, are outside it; processes of the server's own OS user are inside it (they can read its secret
file, attach a debugger or kill it anyway).

- ``secret_file``: the server's secret file and tenants' credential files (format, default paths, writing).
- ``curve``: the CurveZMQ keypairs a secret derives, and a client socket set up with them.
- ``zap``: guarded ROUTER sockets: the ZAP handler accepts only the client keys of the secret file, names
  the tenant a connection belongs to and assigns every routing id.
- ``keyring``: the server's side: the keys it accepts (reloaded when the file changes).
- ``client``: the client's side: which file a socket uses, what a failed handshake means.

The submodules are imported by name (no re-exports here), so ``kvtier.client`` loads only the client's side.
"""
