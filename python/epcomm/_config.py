"""DeepEP's Config. epcomm's queues and worker counts are fixed when a Buffer is created
(Buffer(..., queue_bytes=, num_channels=) and Buffer.num_sms), so a Config passed to
dispatch or combine is accepted and does not change the call; the getters exist so that
DeepEP programs run unchanged."""


class Config:
    def __init__(self, num_sms=20, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=128):
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes a Buffer's normal mode takes with epcomm's default queues (1 MiB per peer and
        channel, a receive and a combine area): any number of tokens fits through them."""
        return 2 * num_ranks * (1 << 20)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 0  # one host: no RDMA buffer

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, "
                f"nvl_send={self.num_max_nvl_chunked_send_tokens}, "
                f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, "
                f"rdma_send={self.num_max_rdma_chunked_send_tokens}, "
                f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})")
