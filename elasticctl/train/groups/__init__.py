"""A worker's generations and their process groups: the two memberships (restart and hot mode),
the workers' rounds in etcd, a generation's process group on its own store and the gloo side
group, torch's in-place reconfiguration (the one module on that experimental API), the
connections a failed generation shuts down, and the abort of a group whose member was lost."""
