"""etcd v3 access: the client, the embedded server, watched prefixes."""
