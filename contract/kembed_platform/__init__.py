"""Code the platform's two halves share and a trainer never needs: minting each tenant's S3 credentials and
its IAM policy (API and operator), and the local backend's kernel sandbox. It stands on kembed_contract only; the
trainer image does not ship it."""
