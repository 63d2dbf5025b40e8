//! How is the socket encrypted? TLS for `wss://` (`[tls] cert` and `key`, PEM files), through
//! rustls with the ring provider.
//!
//! The certificate and key are read and checked at start-up (by [`super::Access::load`]), so
//! a wrong path or a key that does not match fails with the path in the message, never at the
//! first client.

use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::{ConfigError, TlsConfig, invalid};

/// A ready TLS acceptor (cheap to clone).
#[derive(Clone)]
pub struct Tls(pub TlsAcceptor);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tls")
    }
}

impl Tls {
    /// The acceptor `[tls]` describes.
    pub fn open(cfg: &TlsConfig) -> Result<Tls, ConfigError> {
        Tls::load(&cfg.cert, &cfg.key)
    }

    /// Reads a PEM certificate chain and private key.
    pub fn load(cert: &Path, key: &Path) -> Result<Tls, ConfigError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .and_then(|it| it.collect())
            .map_err(|e| invalid("tls.cert", format!("cannot read {}: {e}", cert.display())))?;
        if certs.is_empty() {
            return Err(invalid(
                "tls.cert",
                format!("{} holds no PEM certificate", cert.display()),
            ));
        }
        let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
            invalid(
                "tls.key",
                format!("cannot read a PEM private key from {}: {e}", key.display()),
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("tls", e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(certs, key_der)
            .map_err(|e| {
                invalid(
                    "tls.key",
                    format!(
                        "{} does not fit the certificate in {}: {e}",
                        key.display(),
                        cert.display()
                    ),
                )
            })?;
        Ok(Tls(TlsAcceptor::from(Arc::new(config))))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use crate::net::Access;

    /// The start-up error for a config with this `[tls]` table (parsing, then opening it).
    fn parse(tls: &str, dir: &std::path::Path) -> String {
        let text = format!(
            "[engine]\nmodel = \"m.onnx\"\n[[inputs]]\nkey = \"state\"\ntensor = \"state\"\n\
             dtypes = [\"float32\"]\nshape = [2]\n[[outputs]]\ntensor = \"actions\"\n\
             [tls]\n{tls}\n"
        );
        match Config::parse(&text, "t", Some(dir)) {
            Err(e) => e.to_string(),
            Ok(cfg) => Access::load(&cfg).unwrap_err().to_string(),
        }
    }

    #[test]
    fn bad_tls_files_fail_at_start_up_naming_the_path() {
        let dir = std::env::temp_dir().join(format!("policyd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = parse("cert = \"nope.pem\"\nkey = \"k.pem\"", &dir);
        assert!(e.contains("tls.cert") && e.contains("nope.pem"), "{e}");
        std::fs::write(dir.join("empty.pem"), "not pem\n").unwrap();
        let e = parse("cert = \"empty.pem\"\nkey = \"k.pem\"", &dir);
        assert!(e.contains("holds no PEM certificate"), "{e}");
        let e = parse("cert = \"empty.pem\"", &dir);
        assert!(e.contains("tls.key") && e.contains("missing"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
