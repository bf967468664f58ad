//! Scratch spot check (not committed): one relay process, current-thread runtime.
use skewless_balancer::relay::{RelayHandle, RelaySettings, relay};
fn main() {
    let mut args = std::env::args().skip(1);
    let listen: std::net::SocketAddr = args.next().unwrap().parse().unwrap();
    let backend: std::net::SocketAddr = args.next().unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(listen).await.unwrap();
        loop {
            let (c, _) = l.accept().await.unwrap();
            c.set_nodelay(true).unwrap();
            let b = tokio::net::TcpStream::connect(backend).await.unwrap();
            b.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                relay(c, b, &RelaySettings::default(), RelayHandle::new()).await
            });
        }
    });
}
