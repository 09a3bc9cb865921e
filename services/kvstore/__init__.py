"""The KV store: KV blocks by chained block hash in host RAM and on local disk (``tandem serve kvstore``)."""
