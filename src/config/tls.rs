//! `tls_ca_file`: extra root certificates for an upstream behind a private CA.
//!
//! The file is read, and each certificate in it parsed, when the config is loaded (at start, by
//! `check-config`, on each reload), so a missing or broken file is a config error naming the
//! file, never a handshake failure on the first request. The certificates live in the config
//! itself: a reload that finds the same path with new contents sees a changed upstream and
//! builds its client afresh, and one that finds the same contents keeps the upstream's state.
//!
//! They are added to the webpki roots, never instead of them, and nothing here (or anywhere in
//! corral) turns verification off: the upstream must still present a chain to a trusted root
//! for the host name in its `base_url`.

use std::fmt;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Text;

/// A PEM file of root certificates trusted for one upstream on top of the webpki roots.
#[derive(Clone, PartialEq, Eq)]
pub struct CaFile {
    /// The file: as written (`${VAR}` expanded) until the config loader resolves it against
    /// the config file's directory.
    pub path: PathBuf,
    /// Its certificates (DER) in file order; empty until the loader reads the file, which it
    /// does for every `tls_ca_file` before handing the config out.
    pub certs: Vec<CertificateDer<'static>>,
}

impl CaFile {
    /// Resolve a relative path against `dir` (the config file's directory; `None`: the working
    /// directory), read the file and parse its certificates. The error is a reason that quotes
    /// the resolved path.
    pub(super) fn read(&mut self, dir: Option<&Path>) -> Result<(), String> {
        if let Some(dir) = dir {
            if self.path.is_relative() {
                self.path = dir.join(&self.path);
            }
        }
        let shown = self.path.display();
        let pem = std::fs::read(&self.path).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
        let mut certs = Vec::new();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let n = certs.len() + 1;
            let cert =
                cert.map_err(|e| format!("`{shown}`: certificate {n} is not valid PEM: {e}"))?;
            // Parsed as a trust anchor now, as the client will: a bad certificate is refused
            // here rather than failing every handshake later.
            rustls::RootCertStore::empty()
                .add(cert.clone())
                .map_err(|_| {
                    format!("`{shown}`: certificate {n} is not a valid X.509 certificate")
                })?;
            certs.push(cert);
        }
        if certs.is_empty() {
            return Err(format!(
                "`{shown}` holds no certificate: expected PEM blocks \
                 (`-----BEGIN CERTIFICATE-----`); a DER file must be converted to PEM first"
            ));
        }
        self.certs = certs;
        Ok(())
    }
}

impl<'de> Deserialize<'de> for CaFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Text(path) = Text::deserialize(d)?;
        if path.is_empty() {
            return Err(serde::de::Error::custom(
                "`tls_ca_file` must name a file; leave the key out to trust the webpki roots only",
            ));
        }
        Ok(Self {
            path: path.into(),
            certs: Vec::new(),
        })
    }
}

impl Serialize for CaFile {
    /// The path only: `check-config` prints where the certificates came from.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.path.display())
    }
}

impl fmt::Debug for CaFile {
    /// The path and a count: the certificates themselves are kilobytes of DER.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaFile")
            .field("path", &self.path)
            .field("certs", &self.certs.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use crate::config::load_str;

    /// A directory of its own under the temp dir, removed on drop.
    struct TempDir(std::path::PathBuf);

    impl TempDir {
        fn new() -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::SeqCst);
            let dir = std::env::temp_dir().join(format!("corral-ca-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
        fn write(&self, name: &str, contents: &str) -> String {
            let path = self.0.join(name);
            std::fs::write(&path, contents).unwrap();
            path.display().to_string()
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A config with one upstream whose `tls_ca_file` is `path`, on line 5.
    fn load_with(path: &str) -> Result<crate::config::Config, String> {
        let text = format!(
            "[[upstream]]\nname = \"private\"\nroute = \"/v1\"\nbase_url = \"https://llm.internal/v1\"\ntls_ca_file = \"{path}\"\n"
        );
        load_str("corral.toml", &text).map_err(|e| e.to_string())
    }

    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn every_certificate_of_the_file_is_read_at_load() {
        let dir = TempDir::new();
        let path = dir.write("two.pem", &format!("{}{}", ca_pem(), ca_pem()));
        let config = load_with(&path).unwrap();
        let up = &config.upstreams[0];
        assert_eq!(up.extra_roots().len(), 2);
        assert_eq!(
            up.tls_ca_file
                .as_ref()
                .unwrap()
                .get_ref()
                .path
                .display()
                .to_string(),
            path
        );
    }

    #[test]
    fn a_missing_file_is_refused_with_its_path_and_the_os_reason() {
        let dir = TempDir::new();
        let path = dir.0.join("absent.pem").display().to_string();
        let err = load_with(&path).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "corral.toml:5: upstream[0].tls_ca_file: cannot read `{path}`: "
            )),
            "{err}"
        );
        assert!(err.contains("No such file"), "{err}");
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let dir = TempDir::new();
        // A key alone, as when the wrong one of a pair is named.
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        for (name, contents) in [("empty.pem", ""), ("key.pem", key.as_str())] {
            let path = dir.write(name, contents);
            let err = load_with(&path).unwrap_err();
            assert_eq!(
                err,
                format!(
                    "corral.toml:5: upstream[0].tls_ca_file: `{path}` holds no certificate: \
                     expected PEM blocks (`-----BEGIN CERTIFICATE-----`); a DER file must be \
                     converted to PEM first"
                )
            );
        }
    }

    #[test]
    fn a_broken_certificate_is_refused_with_its_number() {
        let dir = TempDir::new();
        let bad_der = "-----BEGIN CERTIFICATE-----\nAAECAwQF\n-----END CERTIFICATE-----\n";
        let path = dir.write("bad.pem", &format!("{}{bad_der}", ca_pem()));
        let err = load_with(&path).unwrap_err();
        assert_eq!(
            err,
            format!(
                "corral.toml:5: upstream[0].tls_ca_file: `{path}`: certificate 2 is not a valid \
                 X.509 certificate"
            )
        );
        let path = dir.write(
            "base64.pem",
            "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n",
        );
        let err = load_with(&path).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "corral.toml:5: upstream[0].tls_ca_file: `{path}`: certificate 1 is not valid PEM: "
            )),
            "{err}"
        );
    }

    #[test]
    fn an_empty_path_is_refused() {
        let err = load_with("").unwrap_err();
        assert_eq!(
            err,
            "corral.toml:5: upstream.tls_ca_file: `tls_ca_file` must name a file; leave the \
             key out to trust the webpki roots only"
        );
    }

    #[test]
    fn a_relative_path_is_taken_from_the_config_files_directory() {
        let dir = TempDir::new();
        dir.write("ca.pem", &ca_pem());
        let config_path = dir.write(
            "corral.toml",
            "[[upstream]]\nname = \"private\"\nroute = \"/v1\"\nbase_url = \"https://llm.internal/v1\"\ntls_ca_file = \"ca.pem\"\n",
        );
        // The working directory (the crate's, under cargo test) has no ca.pem.
        assert!(!std::path::Path::new("ca.pem").exists());
        let config = crate::config::load_file(std::path::Path::new(&config_path)).unwrap();
        let ca = config.upstreams[0].tls_ca_file.as_ref().unwrap().get_ref();
        assert_eq!(ca.path, dir.0.join("ca.pem"));
        assert_eq!(ca.certs.len(), 1);
    }
}
