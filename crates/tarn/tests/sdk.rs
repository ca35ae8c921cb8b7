//! The real `tarn` binary under the Rust `aws-sdk-s3` with its default settings
//! (request checksums, streaming uploads), over plain HTTP on loopback.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{
    BucketVersioningStatus, CompletedMultipartUpload, CompletedPart, Delete, ObjectIdentifier, Tag,
    Tagging, VersioningConfiguration,
};
use aws_sdk_s3::Client;

const MIB: usize = 1 << 20;

struct Server {
    child: Child,
    endpoint: String,
    admin: String,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tarn"));
        cmd.args([
            "server",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--cores",
            "2",
        ]);
        for i in 0..4 {
            cmd.arg("--drive").arg(dir.path().join(format!("d{i}")));
        }
        cmd.env_remove("TARN_ACCESS_KEY")
            .env_remove("TARN_SECRET_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start tarn");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut endpoint, mut admin) = (None, None);
        while endpoint.is_none() || admin.is_none() {
            let line = lines
                .next()
                .expect("tarn exited before printing its endpoints")
                .unwrap();
            if let Some(e) = line.strip_prefix("S3 endpoint: ") {
                endpoint = Some(e.trim().to_string());
            }
            if let Some(e) = line.strip_prefix("Admin endpoint: ") {
                admin = e.split_whitespace().next().map(str::to_string);
            }
        }
        let (endpoint, admin) = (endpoint.unwrap(), admin.unwrap());
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server {
            child,
            endpoint,
            admin,
            _dir: dir,
        }
    }

    fn client(&self) -> Client {
        self.client_as("tarnadmin", "tarnadmin-secret")
    }

    /// A new user made with `tarn admin user add NAME --json`: its client.
    fn user(&self, name: &str) -> Client {
        let out = Command::new(env!("CARGO_BIN_EXE_tarn"))
            .args([
                "admin",
                "--endpoint",
                &self.admin,
                "--token",
                "tarnadmin-secret",
            ])
            .args(["user", "add", name, "--json"])
            .output()
            .expect("run tarn admin");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let key: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        self.client_as(
            key["access_key"].as_str().unwrap(),
            key["secret_key"].as_str().unwrap(),
        )
    }

    fn client_as(&self, access_key: &str, secret_key: &str) -> Client {
        let http = aws_smithy_http_client::Builder::new().build_http();
        let conf = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .endpoint_url(&self.endpoint)
            .region(Region::new("us-east-1"))
            .credentials_provider(Credentials::new(
                access_key.to_string(),
                secret_key.to_string(),
                None,
                None,
                "test",
            ))
            .force_path_style(true)
            .http_client(http)
            .build();
        Client::from_conf(conf)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by its PID.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().expect("wait for tarn");
        assert!(
            status.success() || std::thread::panicking(),
            "tarn exited with {status}"
        );
    }
}

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn body(c: &Client, bucket: &str, key: &str) -> Vec<u8> {
    c.get_object()
        .bucket(bucket)
        .key(key)
        .send()
        .await
        .unwrap()
        .body
        .collect()
        .await
        .unwrap()
        .into_bytes()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_sdk_s3_end_to_end() {
    let server = Server::start();
    let c = server.client();
    c.create_bucket().bucket("sdk").send().await.unwrap();
    let names: Vec<String> = c
        .list_buckets()
        .send()
        .await
        .unwrap()
        .buckets()
        .iter()
        .filter_map(|b| b.name().map(String::from))
        .collect();
    assert_eq!(names, vec!["sdk".to_string()]);

    // In-memory and streamed bodies, with the SDK's default checksums.
    for (i, size) in [0usize, 1, 100_000, 128 << 10, 3 * MIB + 7]
        .into_iter()
        .enumerate()
    {
        let b = data(i as u64, size);
        let key = format!("mem/{size}");
        c.put_object()
            .bucket("sdk")
            .key(&key)
            .body(ByteStream::from(b.clone()))
            .metadata("step", "42")
            .content_type("application/octet-stream")
            .send()
            .await
            .unwrap();
        assert_eq!(body(&c, "sdk", &key).await, b, "size {size}");
        let path = server._dir.path().join(format!("f{size}"));
        std::fs::write(&path, &b).unwrap();
        let key = format!("file/{size}");
        c.put_object()
            .bucket("sdk")
            .key(&key)
            .body(ByteStream::from_path(&path).await.unwrap())
            .send()
            .await
            .unwrap();
        assert_eq!(body(&c, "sdk", &key).await, b, "streamed size {size}");
    }
    let head = c
        .head_object()
        .bucket("sdk")
        .key("mem/100000")
        .send()
        .await
        .unwrap();
    assert_eq!(head.content_length(), Some(100_000));
    assert_eq!(
        head.metadata().unwrap().get("step").map(String::as_str),
        Some("42")
    );
    let big = data(4, 3 * MIB + 7);
    let r = c
        .get_object()
        .bucket("sdk")
        .key("mem/3145735")
        .range("bytes=1048570-1048580")
        .send()
        .await
        .unwrap();
    assert_eq!(r.content_range(), Some("bytes 1048570-1048580/3145735"));
    assert_eq!(
        r.body.collect().await.unwrap().into_bytes().to_vec(),
        &big[1_048_570..=1_048_580]
    );

    // Listing with a delimiter.
    let l = c
        .list_objects_v2()
        .bucket("sdk")
        .delimiter("/")
        .send()
        .await
        .unwrap();
    let prefixes: Vec<&str> = l
        .common_prefixes()
        .iter()
        .filter_map(|p| p.prefix())
        .collect();
    assert_eq!(prefixes, vec!["file/", "mem/"]);
    let l = c
        .list_objects_v2()
        .bucket("sdk")
        .prefix("mem/")
        .max_keys(2)
        .send()
        .await
        .unwrap();
    assert_eq!(l.key_count(), Some(2));
    assert_eq!(l.is_truncated(), Some(true));
    let next = c
        .list_objects_v2()
        .bucket("sdk")
        .prefix("mem/")
        .continuation_token(l.next_continuation_token().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(next.contents().len(), 3);

    // Copy, tagging.
    c.copy_object()
        .bucket("sdk")
        .key("copy")
        .copy_source("sdk/mem/100000")
        .send()
        .await
        .unwrap();
    assert_eq!(body(&c, "sdk", "copy").await, data(2, 100_000));
    let tagging = Tagging::builder()
        .tag_set(Tag::builder().key("team").value("infer").build().unwrap())
        .build()
        .unwrap();
    c.put_object_tagging()
        .bucket("sdk")
        .key("copy")
        .tagging(tagging)
        .send()
        .await
        .unwrap();
    let tags = c
        .get_object_tagging()
        .bucket("sdk")
        .key("copy")
        .send()
        .await
        .unwrap();
    assert_eq!(tags.tag_set()[0].value(), "infer");

    // Multipart.
    let up = c
        .create_multipart_upload()
        .bucket("sdk")
        .key("mp")
        .send()
        .await
        .unwrap();
    let id = up.upload_id().unwrap();
    let parts = [data(10, 5 * MIB), data(11, 1000)];
    let mut done = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        let r = c
            .upload_part()
            .bucket("sdk")
            .key("mp")
            .upload_id(id)
            .part_number(i as i32 + 1)
            .body(ByteStream::from(p.clone()))
            .send()
            .await
            .unwrap();
        done.push(
            CompletedPart::builder()
                .part_number(i as i32 + 1)
                .e_tag(r.e_tag().unwrap())
                .build(),
        );
    }
    let listed = c
        .list_parts()
        .bucket("sdk")
        .key("mp")
        .upload_id(id)
        .send()
        .await
        .unwrap();
    assert_eq!(listed.parts().len(), 2);
    c.complete_multipart_upload()
        .bucket("sdk")
        .key("mp")
        .upload_id(id)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .set_parts(Some(done))
                .build(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(body(&c, "sdk", "mp").await, parts.concat());

    // Errors come back as typed service errors.
    let err = c
        .get_object()
        .bucket("sdk")
        .key("missing")
        .send()
        .await
        .unwrap_err();
    assert!(err.into_service_error().is_no_such_key());
    let err = c.head_bucket().bucket("nope").send().await.unwrap_err();
    assert!(err.into_service_error().is_not_found());

    // DeleteObjects (the SDK sends its checksum), then versioning.
    let objects = ["copy", "mp"]
        .iter()
        .map(|k| ObjectIdentifier::builder().key(*k).build().unwrap())
        .collect::<Vec<_>>();
    let r = c
        .delete_objects()
        .bucket("sdk")
        .delete(
            Delete::builder()
                .set_objects(Some(objects))
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.deleted().len(), 2);
    c.put_bucket_versioning()
        .bucket("sdk")
        .versioning_configuration(
            VersioningConfiguration::builder()
                .status(BucketVersioningStatus::Enabled)
                .build(),
        )
        .send()
        .await
        .unwrap();
    let v1 = c
        .put_object()
        .bucket("sdk")
        .key("v")
        .body(ByteStream::from_static(b"one"))
        .send()
        .await
        .unwrap()
        .version_id()
        .unwrap()
        .to_string();
    c.put_object()
        .bucket("sdk")
        .key("v")
        .body(ByteStream::from_static(b"two"))
        .send()
        .await
        .unwrap();
    let old = c
        .get_object()
        .bucket("sdk")
        .key("v")
        .version_id(&v1)
        .send()
        .await
        .unwrap();
    assert_eq!(
        old.body.collect().await.unwrap().into_bytes().as_ref(),
        b"one"
    );
    let versions = c
        .list_object_versions()
        .bucket("sdk")
        .prefix("v")
        .send()
        .await
        .unwrap();
    assert_eq!(versions.versions().len(), 2);
}

/// Two users under the Rust SDK: bob cannot read, list, write, delete or
/// copy from alice's bucket until her bucket policy grants it, and can
/// exactly what it grants then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_and_bucket_policies() {
    let server = Server::start();
    let (alice, bob) = (server.user("alice"), server.user("bob"));
    alice
        .create_bucket()
        .bucket("alice-b")
        .send()
        .await
        .unwrap();
    bob.create_bucket().bucket("bob-b").send().await.unwrap();
    alice
        .put_object()
        .bucket("alice-b")
        .key("k")
        .body(ByteStream::from_static(b"alice's"))
        .send()
        .await
        .unwrap();
    let denied = |e: String| assert!(e.contains("AccessDenied") || e.contains("403"), "{e}");
    let try_all = |allowed_read: bool| {
        let bob = bob.clone();
        async move {
            let get = bob.get_object().bucket("alice-b").key("k").send().await;
            let list = bob.list_objects_v2().bucket("alice-b").send().await;
            let copy = bob
                .copy_object()
                .bucket("bob-b")
                .key("c")
                .copy_source("alice-b/k")
                .send()
                .await;
            assert_eq!(get.is_ok(), allowed_read);
            assert_eq!(list.is_ok(), allowed_read);
            assert_eq!(copy.is_ok(), allowed_read);
            if !allowed_read {
                denied(format!("{:?}", get.unwrap_err().into_service_error()));
            }
            let put = bob
                .put_object()
                .bucket("alice-b")
                .key("x")
                .body(ByteStream::from_static(b"bob's"))
                .send()
                .await;
            denied(format!("{:?}", put.unwrap_err().into_service_error()));
            let del = bob.delete_object().bucket("alice-b").key("k").send().await;
            denied(format!("{:?}", del.unwrap_err().into_service_error()));
        }
    };
    try_all(false).await;
    let policy = r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow",
        "Principal":{"AWS":"bob"},"Action":["s3:GetObject","s3:ListBucket"],
        "Resource":["arn:aws:s3:::alice-b","arn:aws:s3:::alice-b/*"]}]}"#;
    alice
        .put_bucket_policy()
        .bucket("alice-b")
        .policy(policy)
        .send()
        .await
        .unwrap();
    try_all(true).await;
    assert_eq!(body(&bob, "bob-b", "c").await, b"alice's");
    let malformed = alice
        .put_bucket_policy()
        .bucket("alice-b")
        .policy("{\"Statement\": 1}")
        .send()
        .await
        .unwrap_err();
    assert!(format!("{:?}", malformed.into_service_error()).contains("MalformedPolicy"));
    alice
        .delete_bucket_policy()
        .bucket("alice-b")
        .send()
        .await
        .unwrap();
    try_all(false).await;
    assert_eq!(body(&alice, "alice-b", "k").await, b"alice's");
}
