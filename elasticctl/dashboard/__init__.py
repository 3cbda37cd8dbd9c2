"""`elasticctl dashboard`: a read-only live page and Prometheus metrics of the jobs on an etcd (or of
one, `--job`), from etcd alone.

``model`` is pure (what was read from etcd -> the page's JSON and the metric values),
``server`` the I/O edge (etcd reads, routes, ``/metrics``), ``static/`` the page (one
``index.html``, one ``dashboard.js``, uPlot vendored: no CDN, works offline).
"""
